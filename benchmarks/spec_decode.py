"""Speculative decoding on and off: output tokens/s and acceptance on the same prompts.

A real chat model (SmolLM2-135M-Instruct, the GGUF in ../shared/models, loaded as bf16 or
fp32) on tasks whose answers copy from their input, where prompt lookup has something to
find (correcting or rewriting a paragraph), on edits of code given in the prompt (which this
small model rewrites more than it copies), and on open questions, where it has little.
Greedy, 128 output tokens; batch 1 and 8 by default (--batches), runs interleaved (off, on, ...);
the CPU pressure of each run is printed and runs over 5% are flagged. The last column counts
the requests whose output is identical on and off: all of them in float32; in bf16 (the
default) a window of five rows goes through other kernels than one row does (AMX tiles
against dot products, other summation orders), and a near tie can come out the other way.

    python benchmarks/spec_decode.py [--model PATH] [--dtype bfloat16|float32] [--rounds 2] [--k 4]
        [--batches 1,8,32] [--method ngram|suffix|draft_model] [--draft-quantization int4]

With --method draft_model the target is the GGUF's weights decoded to a bf16 folder (written
once under ~/.cache/dolmus-bench; the GGUF's tokenizer), and the draft the same folder
quantized on load (int4 by default): a real draft of the same tokenizer at a third of the
bytes. Greedy drafts, as every request here is greedy.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pressure import cpu_pressure_total  # noqa: E402  (benchmarks/, next to this script)

DEFAULT_MODEL = Path(__file__).resolve().parents[1].parent / "shared/models/smollm2-135m-instruct"
PARAGRAPH = (
    "The river rose quickly after three days of rain. Farmers moved their animals to the hills, "
    "and the school in the valley closed its doors. By Friday the water had reached the old bridge, "
    "and the mayor asked everyone to stay away from the banks until the level dropped."
)
CODE = (
    "def total(items):\n    result = 0\n    for item in items:\n        result = result + item.price\n"
    "    return result\n\n\ndef count(items):\n    result = 0\n    for item in items:\n"
    "        result = result + 1\n    return result\n"
)
TYPOS = (
    "The river rose quikly after three days of rain. Farmers moved there animals to the hills, "
    "and the school in the vally closed its doors. By Friday the water had reached the old bridge, "
    "and the mayor asked everyone to stay away from the banks untill the level dropped."
)
# Answers that copy most of their input: what prompt lookup is for (the model does copy these).
COPYING = [
    f"Correct the spelling mistakes in this paragraph and return the corrected paragraph:\n\n{TYPOS}",
    f"Rewrite this paragraph with British spelling, changing nothing else:\n\n{PARAGRAPH}",
    f"Repeat the following text exactly, then say 'done':\n\n{PARAGRAPH}",
    f"Put each sentence of this paragraph on its own line:\n\n{PARAGRAPH}",
]
# Edits of code given in the prompt: a 135M model rewrites the code rather than editing it,
# so its answers copy little; reported apart so the copying rows are not flattered.
CODE_EDITS = [
    f"Add type hints to this Python code and return the whole file:\n\n{CODE}",
    f"Rename `result` to `acc` in this code and show all of it:\n\n{CODE}",
    f"Fix the bug in this code (it should sum the prices) and return the whole corrected code:\n\n{CODE}",
    f"Here is some code:\n\n{CODE}\nReturn the same code with a docstring added to each function.",
]
OPEN = ["Why is the sky blue?", "Give three tips for a job interview.", "What is a prime number?",
        "Write a short poem about the sea."]  # fmt: skip


def bf16_folder(gguf: Path) -> Path:
    """The GGUF's weights decoded into a bf16 safetensors folder (config.json from its
    metadata), written once: a full-precision target to put a quantized draft beside."""
    import json

    import torch
    from safetensors.torch import save_file

    from dolmus.config import ModelConfig
    from dolmus.runtime.gguf_loader import gguf_config, iter_gguf_weights

    out = Path.home() / ".cache/dolmus-bench" / f"{gguf.stem}-bf16"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    raw = gguf_config(gguf)
    raw["torch_dtype"] = "bfloat16"
    cfg = ModelConfig.from_dict(raw)
    tensors = {}
    for name, w in iter_gguf_weights(gguf, cfg.architecture, cfg.num_heads, cfg.num_kv_heads):
        w = w.dequantize() if hasattr(w, "dequantize") else w
        tensors[name] = w.to(torch.bfloat16).contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(raw, default=str))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(next(DEFAULT_MODEL.glob("*.gguf"), DEFAULT_MODEL)))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes (each a multiple of 4, or 1)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix", "draft_model"])
    ap.add_argument("--draft-quantization", default="int4", help="draft_model: the draft copy's quantization")
    args = ap.parse_args()

    from dolmus import LLM, SamplingParams

    spec = {"method": args.method, "num_speculative_tokens": args.k}
    common = {"dtype": args.dtype, "num_threads": args.num_threads}
    model = args.model
    if args.method == "draft_model":
        model = str(bf16_folder(Path(args.model)))
        common["tokenizer"] = args.model
        spec |= {"model": model, "quantization": args.draft_quantization}
    llms = {"off": LLM(model, **common), "on": LLM(model, speculative_config=spec, **common)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    workloads = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for kind, prompts in (("copying", COPYING), ("code edits", CODE_EDITS), ("open", OPEN)):
            runs = [[p] for p in prompts] if batch == 1 else [prompts * (batch // len(prompts))]
            workloads[f"{kind}, batch {batch}"] = runs
    best: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], list] = {}
    acceptance: dict[str, tuple[int, int, int]] = {}
    for name, batches in workloads.items():
        for _ in range(args.rounds):
            for mode, llm in llms.items():
                before = llm.engine.stats()
                pressure, start = cpu_pressure_total(), time.monotonic()
                tokens, texts = 0, []
                for batch in batches:
                    convs = [[{"role": "user", "content": p}] for p in batch]
                    for out in llm.chat(convs, params):
                        tokens += len(out.outputs[0].token_ids)
                        texts.append(out.outputs[0].token_ids)
                seconds = time.monotonic() - start
                stall = (cpu_pressure_total() - pressure) / 1e6 / seconds
                rate = tokens / seconds
                after = llm.engine.stats()
                flag = "  (disturbed)" if stall > 0.05 else ""
                print(
                    f"{name:18s} {mode:3s}: {rate:7.1f} tok/s  cpu pressure {100 * stall:4.1f}%{flag}",
                    flush=True,
                )
                if stall <= 0.05:
                    best[(name, mode)] = max(best.get((name, mode), 0.0), rate)
                outputs[(name, mode)] = texts
                if mode == "on":
                    acceptance[name] = (
                        after.spec_num_drafts - before.spec_num_drafts,
                        after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                    )
    columns = ["workload", "off tok/s", "on tok/s", "on / off", "drafted", "accepted"]
    columns += ["mean accepted per draft step", "identical outputs"]
    print("\n| " + " | ".join(columns) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in workloads:
        off, on = best.get((name, "off")), best.get((name, "on"))
        drafts, drafted, accepted = acceptance[name]
        ratio = f"{on / off:.2f}x" if off and on else "n/a"
        pairs = list(zip(outputs[(name, "off")], outputs[(name, "on")]))
        same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        mean = 1 + accepted / drafts if drafts else 1.0
        cells = [name, f"{off or 0:.1f}", f"{on or 0:.1f}", ratio, drafted, accepted, f"{mean:.2f}", same]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()

"""Quality of GGUF files as we run them: perplexity and KL against the same file in float32.

For each file, the reference is the file run in float32 on our block kernels, which is
exactly the weights the gguf package decodes (the tests check that bit for bit); against it,
the default bf16 run (where the CPU has AVX-512 BF16: 4-bit blocks on the int4 kernel, the
others on the grouped int8 kernel, bf16 activations; elsewhere the block kernels under bf16
layers) and the float32 run with `gguf_activations="int8"` (the block kernels' 8-bit blocks
take x rounded to int8 per block of 32 at decode, as llama.cpp does). Texts: the held-out stories
(tests/data/heldout_stories.txt) and, for chat models, a few chat answers the float32 run
wrote itself (prompt and answer, scored whole). Every text is scored one token at a time
through the KV cache, as decoding reads it.

    python benchmarks/gguf_quality.py FILE.gguf [FILE.gguf ...] [--stories 10]

Files with K-quants: llama.cpp's `llama-quantize` makes them (see gguf_vs_llama_server.py for
building llama.cpp), e.g. `llama-quantize --allow-requantize in.gguf out.gguf Q4_K_M`.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quant_quality import STORIES, mean_kl, perplexity  # noqa: E402

from dolmus import LLM, SamplingParams  # noqa: E402

CHAT_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for a job interview.",
]
RUNS = {
    "bf16": {"dtype": "bfloat16"},
    "float32, int8 activations": {"dtype": "float32", "gguf_activations": "int8"},
}


def _types(path: Path) -> str:
    import gguf

    counts = collections.Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--stories", type=int, default=10, help="held-out stories to score")
    args = parser.parse_args()
    stories = [s for s in STORIES.read_text().splitlines() if s.strip()][: args.stories]
    print("| file | tensors | run | text | perplexity | vs float32 | mean KL(f32 ‖ run) nats |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for path in args.files:
        reference = LLM(model=str(path), dtype="float32", kv_cache_memory=256 << 20)
        tok = reference.tokenizer
        texts = {"stories": [tok.encode(s) for s in stories]}
        if tok.chat_template:
            params = SamplingParams(temperature=0, max_tokens=96)
            chats = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
            answers = reference.chat(chats, params)
            texts["chat answers"] = [list(a.prompt_token_ids) + list(a.outputs[0].token_ids) for a in answers]
        base = {name: score_ids(reference, ids) for name, ids in texts.items()}
        del reference
        types = _types(path)
        for name, ids in texts.items():
            ppl = perplexity(base[name], ids)
            print(f"| {path.name} | {types} | float32 | {name} | {ppl:.3f} | | |")
        for run, kw in RUNS.items():
            llm = LLM(model=str(path), kv_cache_memory=256 << 20, **kw)
            for name, ids in texts.items():
                lp = score_ids(llm, ids)
                ppl, ref = perplexity(lp, ids), perplexity(base[name], ids)
                kl = mean_kl(base[name], lp)
                change = f"{100 * (ppl / ref - 1):+.2f}%"
                print(f"| {path.name} | {types} | {run} | {name} | {ppl:.3f} | {change} | {kl:.5f} |")
            del llm


def score_ids(llm: LLM, token_ids: list[list[int]]) -> list:
    return [llm.engine.prompt_logprobs(ids, chunk_size=1) for ids in token_ids]


if __name__ == "__main__":
    main()

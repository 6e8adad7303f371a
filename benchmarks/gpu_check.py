"""One short script for a lent GPU: do the CUDA quantization paths run, agree and pay off?

Never run yet (no device was lent while they were written). On a CUDA machine it builds the
Qwen2.5-0.5B-shaped random model (offline_throughput.py), then for bf16 and each of
`--quantization int8 | int4 | fp8` (the Triton weight-only kernel and torch._scaled_mm):
checks teacher-forced next-token agreement and KL against bf16 on 256 positions, and
prints batch-1 and 32-request decode tok/s; then the rank-process path (an NCCL group of one;
the model in rank processes, tensor-parallel over up to 2 GPUs, against in-process). Exits 0
with a line per check; a check that fails prints its error and the rest still run.

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import qwen05b_shape_dir  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    from dolmus import LLM, SamplingParams

    model = str(qwen05b_shape_dir())
    ids = torch.randint(100, 150000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    reference = None
    print(torch.cuda.get_device_name(), torch.__version__)
    for quant in (None, "int8", "int4", "fp8"):
        try:
            llm = LLM(model=model, dtype="bfloat16", device="cuda", quantization=quant)
            logprobs = llm.engine.prompt_logprobs(ids).float().cpu()
            if reference is None:
                reference = logprobs
            agree = (logprobs.argmax(-1) == reference.argmax(-1)).float().mean().item()
            kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
            rates = []
            for batch in (1, 32):
                params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
                outs = llm.generate([ids[:32]] * batch, params)
                rates.append(sum(1.0 / o.outputs[0].metrics.tpot for o in outs))
            print(
                f"{quant or 'bf16'}: argmax agreement {agree:.3f}, KL {kl:.4f}, "
                f"decode tok/s batch 1 {rates[0]:.1f}, 32 requests {rates[1]:.1f}",
                flush=True,
            )
            del llm
        except Exception:  # report and go on: one broken format must not hide the others
            print(f"{quant}: FAILED\n{traceback.format_exc()}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    check_ranks(model, ids)


def _nccl_rank(port: int, out: dict) -> None:
    from dolmus.distributed.process_group import join_process_group, leave_process_group

    join_process_group(0, 1, 0, 1, "127.0.0.1", port, torch.device("cuda", 0), 60)
    x = torch.ones(4, device="cuda")
    torch.distributed.all_reduce(x)
    out["sum"] = x.sum().item()
    leave_process_group()


def check_ranks(model: str, ids: list[int]) -> None:
    """The rank-process path on CUDA: an NCCL group of one, then the model in rank processes
    (tensor parallelism over every GPU there is, up to 2) against the in-process run."""
    import torch.multiprocessing as mp

    from dolmus import LLM, SamplingParams
    from dolmus.executor.multiproc import free_port

    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_nccl_rank, args=(free_port(), out), nprocs=1)
            print(f"NCCL group of one: all_reduce sum {out['sum']} (expect 4.0)", flush=True)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        prompts = [ids[:32], ids[32:96]]
        want = [
            o.outputs[0].token_ids
            for o in LLM(model=model, dtype="bfloat16", device="cuda").generate(prompts, params)
        ]
        tp = min(2, torch.cuda.device_count())
        llm = LLM(model=model, dtype="bfloat16", device="cuda", executor="mp", tensor_parallel_size=tp)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)
        print(
            f"rank processes (tensor_parallel_size {tp}): {same:.3f} of greedy tokens as in-process",
            flush=True,
        )
        llm.engine.shutdown()
    except Exception:
        print(f"rank processes: FAILED\n{traceback.format_exc()}", flush=True)


if __name__ == "__main__":
    main()

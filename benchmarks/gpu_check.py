"""One short script for a lent GPU: is dolmus right on CUDA, how close to the hardware does it
run, and how far ahead of transformers is it? Fast sections first, each bounded in time and
failing alone (its traceback printed, the rest still run):

  1  device, versions, measured copy bandwidth and bf16 matmul TFLOP/s
  2  greedy tokens against transformers on the GPU (float32) for every tiny test fixture
     (dense, MoE, Gemma 3, sliding window, DeepSeek), eager and with CUDA graphs
  3  Qwen2.5-0.5B-shaped random model: bytes read per decoded token, the HBM roofline, and
     batch-1 decode tok/s for bf16 (graphs, eager), fp8 and int4
  4  nano-vllm's benchmark shape (256 requests, prompt and output lengths uniform in
     100..1024): offline throughput for the same four, and transformers on a subset
  5  GPU idle share of decode steps at --idle-batches (default 64), with and without async
     scheduling, then where a step's host time goes and the kernels by time (profilers last:
     they slow every later graph launch in the process, so run this section last too;
     the section is in gpu_check_idle.py)
  6  the rank-process path: an NCCL group of one, the model in rank processes

Everything also goes to $OUT/gpu_check.log; a summary table is printed last (and on SIGTERM).
Wheels that benchmarks/gpu_wheels.sh left in .whl/ are unpacked and used where this Python
lacks them. --deadline (default 540 s from start) skips later sections and clips budgets so
the summary prints before a caller's time limit.

    python benchmarks/gpu_check.py [--sections 1,2,3,4,5,6] [--deadline 540]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no generate() warnings in a short tail
os.environ.setdefault("DOLMUS_BENCH_CACHE", "/tmp/dolmus-bench")  # read by offline_throughput

import torch

STARTED = time.monotonic()
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent)]
from gpu_check_idle import s5_idle  # noqa: E402
from gpu_check_lib import (  # noqa: E402
    Deadline,
    config_read_bytes,
    copy_bandwidth,
    decode_read_bytes,
    drive,
    free_memory,
    install_term_handler,
    matmul_flops,
    print_summary,
    say,
    section,
    start_log,
    use_wheels,
)
from gpu_check_models import (  # noqa: E402
    FORMATS,
    Ctx,
    GiB,
    batch1_rate,
    fixture_builders,
    hf_greedy_on,
    hf_throughput,
    nano_vllm_workload,
)


def s1_device(ctx: Ctx, deadline: Deadline) -> None:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    say(
        f"{name}; python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {triton_version}, transformers {transformers.__version__}",
        f"S1 {name}, torch {torch.__version__}, triton {triton_version}, "
        f"transformers {transformers.__version__}",
    )
    size = 2**26 if ctx.quick else 4 * GiB
    ctx.bandwidth = copy_bandwidth(ctx.device, size)
    say(
        f"copy bandwidth {ctx.bandwidth / 1e9:.0f} GB/s (bytes read + written, {size / GiB:.2f} GiB copy, "
        "median of 10)",
        f"S1 copy bandwidth {ctx.bandwidth / 1e9:.0f} GB/s",
    )
    n = 1024 if ctx.quick else 8192
    flops = matmul_flops(ctx.device, n)
    say(f"bf16 matmul {n}^3: {flops / 1e12:.1f} TFLOP/s", f"S1 bf16 matmul {flops / 1e12:.0f} TFLOP/s")


def s2_agreement(ctx: Ctx, deadline: Deadline) -> None:
    from dolmus import SamplingParams

    lengths, new = ((1, 17), 8) if ctx.quick else ((1, 17, 130, 300), 24)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    say(
        f"prompts of {lengths} tokens, {new} new tokens each; "
        "equal tokens / total (first mismatch per prompt)"
    )
    for name, build in fixture_builders(ctx.quick):
        if deadline.over():
            say(f"{name}: skipped (section out of time)", f"S2 {name:<16} skipped (time)")
            continue
        try:
            folder = ctx.root / name
            if not (folder / "config.json").exists():
                folder = build(folder)
            want = hf_greedy_on(folder, prompts, new, ctx.device)
            cells = []
            for label, eager in (("eager", True), ("graphs", False)):
                llm = ctx.llm(
                    folder, dtype="float32", enforce_eager=eager, max_num_seqs=4, kv_cache_memory=2**28
                )
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
                llm.engine.shutdown()
                del llm
                free_memory(ctx.device)
                equal = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
                firsts = [
                    next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)
                ]
                where = "" if all(f is None for f in firsts) else f" (first mismatch {firsts})"
                cells.append(f"{label} {equal}/{len(prompts) * new}{where}")
            say(
                f"{name:<16} " + ", ".join(cells),
                f"S2 {name:<16} " + ", ".join(c.split(" (")[0] for c in cells),
            )
        except Exception as exc:  # one fixture failing must not hide the others
            say(f"{name}: FAILED\n{traceback.format_exc()}", f"S2 {name:<16} FAILED {type(exc).__name__}")
            free_memory(ctx.device)
    say(f"TF32 matmuls allowed after these runs: {torch.backends.cuda.matmul.allow_tf32}")


def s3_roofline(ctx: Ctx, deadline: Deadline) -> None:
    from transformers import AutoConfig

    t0 = time.perf_counter()
    folder = ctx.big_model()
    cfg = AutoConfig.from_pretrained(folder)
    say(f"model {folder} ready in {time.perf_counter() - t0:.1f} s")
    bw = ctx.measured_bandwidth()
    by_config = config_read_bytes(cfg)
    say(
        f"bf16 bytes per token from the config: {by_config / 1e6:.1f} MB; roofline at {bw / 1e9:.0f} GB/s: "
        f"{bw / by_config:.0f} tok/s"
    )
    new = 32 if ctx.quick else 256
    for i, label in enumerate(FORMATS):
        if deadline.over():
            say(f"{label}: skipped (section out of time)", f"S3 {label:<12} skipped (time)")
            continue
        try:
            llm = ctx.engine(label)
            try:
                nbytes = decode_read_bytes(llm.engine.executor.runner.model)
            except Exception as exc:  # a runner laid out otherwise: weights as stored, less the table
                table = cfg.vocab_size * cfg.hidden_size * 2  # read whole only as a bf16 tied head
                head_is_table = cfg.tie_word_embeddings and "quantization" not in FORMATS[label]
                nbytes = llm.engine.stats().weight_bytes - (0 if head_is_table else table)
                say(f"  ({label}: no module walk ({exc!r}); bytes from the stored weights)")
            batch1_rate(llm, cfg.vocab_size, 16, seed=100 + i)  # warm-up: kernels compile
            rate = max(batch1_rate(llm, cfg.vocab_size, new, seed=200 + 10 * i + r) for r in range(2))
            roof = bw / nbytes
            say(
                f"{label:<12} batch 1: {rate:8.0f} tok/s, {nbytes / 1e6:7.1f} MB read per token, roofline "
                f"{roof:7.0f} tok/s, {rate / roof:6.1%} of it",
                f"S3 {label:<12} b1 {rate:7.0f} tok/s = {rate / roof:5.1%} of {roof:.0f} "
                f"({nbytes / 1e6:.0f} MB/tok)",
            )
        except Exception as exc:
            say(f"{label}: FAILED\n{traceback.format_exc()}", f"S3 {label:<12} FAILED {type(exc).__name__}")


def s4_throughput(ctx: Ctx, deadline: Deadline) -> None:
    folder = ctx.big_model()
    vocab = 512 if ctx.quick else 150000
    reqs = nano_vllm_workload(ctx.quick, vocab)
    wanted = sum(o for _, o in reqs)
    say(
        f"{len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt and {wanted} output tokens (ignore_eos)"
    )
    # seconds each run may take: the ratio's two runs longest; a cut run reports its rate so far
    caps = {"bf16 graphs": 60.0, "transformers": 45.0}
    rates: dict[str, float] = {}
    for label in ("bf16 graphs", "transformers", "bf16 sync", "bf16 eager", "fp8 graphs", "int4 graphs"):
        if deadline.over():
            say(f"{label}: skipped (section out of time)", f"S4 {label:<12} skipped (time)")
            continue
        cap = min(caps.get(label, 30.0) / (3 if ctx.quick else 1), max(10.0, deadline.left()))
        try:
            if label == "transformers":
                subset = reqs[: 4 if ctx.quick else 64]
                rate, steps, secs = hf_throughput(folder, subset, ctx.device, cap)
                free_memory(ctx.device)
                rates[label] = rate
                cut = f", cut at {cap:.0f} s after {steps} steps" if steps < max(o for _, o in subset) else ""
                say(
                    f"transformers bf16, first {len(subset)} requests in one padded batch: {rate:8.0f} tok/s "
                    f"({secs:.1f} s{cut}) [a subset]",
                    f"S4 transformers {rate:7.0f} tok/s (subset of {len(subset)}, batch {len(subset)})",
                )
                continue
            llm = ctx.engine(label)
            drive(
                llm,
                [(p[::-1][:64], 16) for p, _ in reqs[:32]],  # no prefix of the measured prompts
                30,
            )
            tokens, secs, done = drive(llm, reqs, cap)
            rates[label] = tokens / secs
            cut = (
                "" if done == len(reqs) else f", cut at {cap:.0f} s: {done}/{len(reqs)} done, {tokens} tokens"
            )
            say(
                f"{label:<12} {tokens / secs:8.0f} tok/s ({secs:.1f} s{cut})",
                f"S4 {label:<12} {tokens / secs:7.0f} tok/s{' (partial)' if cut else ''}",
            )
        except Exception as exc:
            say(f"{label}: FAILED\n{traceback.format_exc()}", f"S4 {label:<12} FAILED {type(exc).__name__}")
    if rates.get("transformers") and rates.get("bf16 graphs"):
        ratio = rates["bf16 graphs"] / rates["transformers"]
        say(
            f"dolmus bf16 graphs / transformers: {ratio:.1f}x (goal >= 10x)",
            f"S4 dolmus/transformers {ratio:.1f}x",
        )


def _nccl_rank(_index: int, port: int, out: dict) -> None:
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


def s6_ranks(ctx: Ctx, deadline: Deadline) -> None:
    if ctx.device.type != "cuda":
        say("needs CUDA: skipped")
        return
    ctx.drop_engines()  # their KV pools: the in-process run sizes its pool from free memory
    ids = torch.randint(100, 150000, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    check_ranks(str(ctx.big_model()), ids)


SECTIONS = {
    "1": ("device, bandwidth, matmul", 30, s1_device),
    "2": ("greedy agreement with transformers on the GPU", 150, s2_agreement),
    "3": ("Qwen2.5-0.5B shape: batch-1 decode against the HBM roofline", 90, s3_roofline),
    "4": ("nano-vllm benchmark shape: offline throughput", 240, s4_throughput),
    "5": ("GPU idle share of decode steps (--idle-batches)", 60, s5_idle),
    "6": ("rank processes and NCCL", 60, s6_ranks),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="1,2,3,4,5,6", help="comma-separated section numbers to run")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.log (default: $OUT)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: plumbing check
    ap.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # tiny sizes everywhere
    ap.add_argument("--root", default="/tmp/dolmus-gpu-check", help="folder for the tiny fixtures")
    ap.add_argument(
        "--deadline", type=float, default=540.0, help="seconds from start: later sections are skipped, "
        "budgets clipped, so the summary prints before a caller's time limit (default 540)",
    )  # fmt: skip
    ap.add_argument("--idle-batches", default="64", help="section 5's batch sizes, comma-separated")
    args = ap.parse_args()
    start_log(args.out)
    install_term_handler()
    wheels = use_wheels(HERE.parent / ".whl", Path("/tmp/dolmus-wheels"))
    if wheels:
        say(f"unpacked from .whl/ (absent here): {', '.join(wheels)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        say("no CUDA device: nothing to check")
        return
    if device.type == "cpu":
        torch.set_num_threads(1)
    ctx = Ctx(device, args.quick, Path(args.root))
    ctx.idle_batches = tuple(int(b) for b in args.idle_batches.split(","))
    ctx.root.mkdir(parents=True, exist_ok=True)
    for tag in [t.strip() for t in args.sections.split(",")]:
        title, budget, run = SECTIONS[tag]
        left = args.deadline - (time.monotonic() - STARTED)
        if left < 20:
            say(
                f"\n== {tag}. {title}: skipped, {left:.0f} s left of --deadline", f"S{tag} skipped (deadline)"
            )
            continue
        budget = min(budget / 3 if args.quick else budget, left - 15)
        with section(tag, title, budget, min(2 * budget + 30, left - 5)) as deadline:
            run(ctx, deadline)
    total = time.monotonic() - STARTED
    say(f"\nall sections: {total:.0f} s (from start, imports included)", f"total {total:.0f} s")
    print_summary()


if __name__ == "__main__":
    main()

"""Section 5 of gpu_check.py: the GPU's idle share of decode steps. Decode steps at each
--idle-batches size are timed (the engine's step split by part, the GPU's work alone by
replaying the step's captured graph, one graph launch's host time), then profiled (cProfile
of whole steps, the CUDA runtime calls on the host, the GPU busy share and the kernels by
time). Imported by gpu_check.py, which puts this folder on sys.path first.
"""

from __future__ import annotations

import random
import time

import torch
from gpu_check_lib import Deadline, StepTimer, gpu_busy, runtime_calls, say
from gpu_check_models import Ctx


def s5_idle(ctx: Ctx, deadline: Deadline) -> None:
    """Timed runs first, profiled ones after: once torch.profiler (CUPTI) has run in a process,
    every later graph launch costs the host ~10x (measured on the H200: 21 -> ~150 us)."""
    runs = [(count, label) for count in ctx.idle_batches for label in ("bf16 graphs", "bf16 sync")]
    for profiled in (False, True):
        for count, label in runs:
            if deadline.over():
                say(f"{label} batch {count}: skipped (section out of time)", f"S5 b{count} skipped (time)")
                continue
            how = "profiled" if profiled else "timed"
            say(f"-- {label} (async scheduling {'off' if 'sync' in label else 'on'}), {how}")
            idle_at(ctx, min(count, 8) if ctx.quick else count, label, profiled)


def _decoding(ctx: Ctx, engine, count: int, steps: int) -> list[str]:
    """`count` requests with 128-token prompts, past their prefill: every next step decodes."""
    from dolmus import SamplingParams

    prompt_len = 16 if ctx.quick else 128
    rng = random.Random(5)
    ids = [f"idle-{i}" for i in range(count)]
    params = SamplingParams(temperature=0, max_tokens=prompt_len + 3 * steps + 200, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, 500) for _ in range(prompt_len)], params, 0)
    decoding: set[str] = set()
    for _ in range(200):  # until every prompt is in (the next steps are decode only)
        decoding |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
        if len(decoding) == count:
            break
    for _ in range(5):
        engine.step()
    ctx.sync()
    return ids


def idle_at(ctx: Ctx, count: int, label: str, profiled: bool) -> None:
    """Decode steps at one batch size. Timed: the engine's step split by part, the GPU's work
    alone, one graph launch's host time. Profiled: where the host's time goes (cProfile, CUDA
    runtime calls), the GPU busy share and the kernels by time with launches per step."""
    engine = ctx.engine(label).engine
    steps = 10 if ctx.quick else 50
    ids = _decoding(ctx, engine, count, steps)
    try:
        if profiled:
            profile_steps(ctx, engine, count, steps, label)
        else:
            time_steps(ctx, engine, count, steps, label)
    finally:
        for rid in ids:
            engine.abort_request(rid)


def time_steps(ctx: Ctx, engine, count: int, steps: int, label: str) -> None:
    try:
        timer = StepTimer(engine)
    except Exception as exc:  # a breakdown is a bonus
        say(f"(no step breakdown: {exc})")
        timer = None
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ctx.sync()
    step_s = (time.perf_counter() - t0) / steps
    if timer is not None:
        timer.restore()
        parts = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in timer.seconds.items())
        rest = step_s - sum(timer.seconds.values()) / steps
        say(
            f"batch {count} decode step {step_s * 1e3:.2f} ms: {parts}, "
            f"rest (outputs, detokenizer) {rest * 1e3:.2f} ms"
        )
    say(f"S5 {label} b{count}: step {step_s * 1e3:.2f} ms", f"S5 {label} b{count} step {step_s * 1e3:.2f} ms")
    gpu_work(ctx, engine, count, steps, step_s, f"{label} b{count}")


def profile_steps(ctx: Ctx, engine, count: int, steps: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ctx.sync()
        step_s = (time.perf_counter() - t0) / steps
    if count > 1:
        host_profile(ctx, engine, steps)
    calls = runtime_calls(prof)
    if calls:
        slowest = sorted(calls.items(), key=lambda kv: -kv[1][0])[:6]
        say("  CUDA runtime calls on the host, longest: " + ", ".join(
            f"{name} {secs / steps * 1e3:.3f} ms/step ({n / steps:.0f}/step)" for name, (secs, n) in slowest
        ))  # fmt: skip
    busy, events, by_name = gpu_busy(prof)
    say(f"profiler: {events} GPU activities over {steps} steps; step {step_s * 1e3:.2f} ms profiled")
    if not events:
        say(
            "  no GPU activity recorded (graph replays not traced?): no idle share", "S5 no GPU events traced"
        )
        return
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[: 6 if count > 1 else 16]
    launches = sum(calls for _, calls in by_name.values()) / steps
    say(f"  {launches:.0f} GPU activities per step; the longest:")
    for name, (secs, calls) in top:
        say(
            f"  {secs / steps * 1e3:7.3f} ms/step {calls / steps:5.0f}/step "
            f"{secs / calls * 1e6:7.1f} us each  {name[:80]}"
        )
    share = min(1.0, busy / steps / step_s)
    say(
        f"GPU busy {share:.0%} of each profiled step ({step_s * 1e3:.2f} ms)",
        f"S5 {label} b{count} profiled: GPU busy {share:.0%} of {step_s * 1e3:.2f} ms",
    )


def host_profile(ctx: Ctx, engine, steps: int) -> None:
    """cProfile of whole steps: where the host's time goes (a call that waits for the device
    shows up with the wait in its own time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    ctx.sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    lines = [line for line in text.getvalue().splitlines() if line.strip()][-15:]
    say(f"  cProfile of {steps} steps (own time first):\n" + "\n".join("    " + line[:150] for line in lines))


def gpu_work(ctx: Ctx, engine, count: int, steps: int, step_s: float, tag: str) -> None:
    """The GPU time of a decode step's work alone: the captured graph of the step's size
    replayed back to back (its inputs as the last step left them: the same keys rewritten to the
    same slots), then the logits and argmax, timed with CUDA events; against the engine's whole
    step, the rest is the GPU waiting on the host."""
    runner = getattr(engine.executor, "runner", None)
    graphs = getattr(runner, "fused_decoder", None)
    if ctx.device.type != "cuda" or graphs is None or not hasattr(graphs, "_graphs"):
        say("(no graphed decode step to time alone)")
        return
    size = next(s for s in graphs.sizes if s >= count)
    captured = graphs._graphs[size]

    def work() -> None:
        captured.replay()
        runner.model.compute_logits(captured.out[:count]).max(dim=-1)

    for _ in range(3):
        work()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        work()
    end.record()
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1e3 / steps
    idle = max(0.0, 1 - gpu_s / step_s)
    say(
        f"GPU work of a batch-{count} decode step alone (graph of {size} rows + logits + argmax): "
        f"{gpu_s * 1e3:.3f} ms; the engine's step {step_s * 1e3:.3f} ms: the GPU idles {idle:.0%} of it",
        f"S5 {tag} GPU work {gpu_s * 1e3:.3f} ms of a {step_s * 1e3:.3f} ms step (GPU idle {idle:.0%})",
    )
    launch_cost(ctx, captured.replay, f"the batch-{count} step's graph", tag)


def launch_cost(ctx: Ctx, replay, what: str, tag: str) -> None:
    """Host time of one graph launch (the device idle before it), against a graph of as many
    one-element adds: what launching costs the host per step, outside any profiler."""
    import statistics

    def host_time(fn) -> float:
        times = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(times)

    ours = host_time(replay)
    x = torch.zeros(1, device=ctx.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(300):
            x.add_(1)
    plain = host_time(graph.replay)
    say(
        f"host time of one launch: {what} {ours * 1e6:.0f} us; a graph of 300 one-element adds "
        f"{plain * 1e6:.0f} us",
        f"S5 {tag} graph launch {ours * 1e6:.0f} us on the host (300 adds: {plain * 1e6:.0f} us)",
    )

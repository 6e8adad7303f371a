"""Helpers of gpu_check.py: a log that survives a cut-off run, sections that fail alone and
stop on time, device timing, the bytes a decode step reads, and an engine driver that stops
at a deadline and counts what it produced.

The device tool returns only the tail of the output, so every line is flushed, also written
to $OUT/gpu_check.log, and collected for a summary printed last (also on SIGTERM).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import statistics
import sys
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Tee:
    """Writes to the terminal and to a log file, flushing both at once."""

    def __init__(self, stream: Any, log: Any) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.stream.flush()
        self.log.write(text)
        self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def start_log(out_dir: str | None) -> None:
    if not out_dir:
        return
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(out_dir) / "gpu_check.log", "a", buffering=1)  # noqa: SIM115 (lives as long as we do)
    sys.stdout = Tee(sys.stdout, log)
    sys.stderr = Tee(sys.stderr, log)


SUMMARY: list[str] = []


def say(text: str, summary: str | None = None) -> None:
    """Print now; `summary`: also a line of the closing table."""
    print(text, flush=True)
    if summary is not None:
        SUMMARY.append(summary)


def print_summary() -> None:
    print("\n==== SUMMARY ====", flush=True)
    for row in SUMMARY:
        print(row, flush=True)


def _on_term(signum: int, frame: Any) -> None:
    print(f"\n(signal {signum}: cut off)", flush=True)
    print_summary()
    os._exit(128 + signum)


def install_term_handler() -> None:
    signal.signal(signal.SIGTERM, _on_term)


class SectionTimeout(Exception):
    pass


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def over(self) -> bool:
        return self.left() <= 0


def _alarm(signum: int, frame: Any) -> None:
    raise SectionTimeout("hard time limit of the section reached")


@contextlib.contextmanager
def section(tag: str, title: str, budget_s: float, hard_s: float) -> Iterator[Deadline]:
    """A soft deadline the section's loops check, and a hard one that interrupts it (when the
    interpreter next runs: a long C call ends first); any failure prints its traceback and the
    run goes on with the next section."""
    say(f"\n== {tag}. {title} (budget ~{budget_s:.0f} s) ==")
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, hard_s)
    try:
        yield Deadline(budget_s)
    except Exception as exc:
        say(f"{tag}: FAILED\n{traceback.format_exc()}", f"S{tag} FAILED: {type(exc).__name__}: {exc}"[:200])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        took = time.monotonic() - start
        say(f"-- {tag} took {took:.1f} s", f"S{tag} took {took:.0f} s")


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def time_op(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Bytes read plus written per second by a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_op(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, n: int, reps: int = 10) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    seconds = time_op(lambda: a @ b, device, reps)
    return 2 * n**3 / seconds


_ROPE_BUFFERS = ("cos", "sin", "freq", "rope", "rotary")


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every linear layer as stored for compute (its
    quantized state instead of a float weight it no longer reads), norms, biases, the LM head
    (a tied head's weight counts once, as the head), and one row of each embedding table."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if "Embedding" in type(module).__name__:
            weight = getattr(module, "weight", None)
            if weight is not None and weight.numel():
                total += weight[0].numel() * weight.element_size()
            continue
        state = getattr(module, "method_state", None)
        tensors = [(n, t) for n, t in module.named_parameters(recurse=False)]
        tensors += [(n, t) for n, t in module.named_buffers(recurse=False) if not n.startswith(_ROPE_BUFFERS)]
        for name, tensor in tensors:
            if tensor is None or not tensor.numel() or tensor.data_ptr() in seen:
                continue
            if state is not None and name == "weight":
                continue  # the quantized (or packed) state is what its matmul reads
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
        held = getattr(module, "state_bytes", None)
        if held is not None:
            total += held()
    return total


def config_read_bytes(cfg: Any, bytes_per_weight: float = 2.0) -> int:
    """The same count from a dense HF config: q/k/v (with biases when `attention_bias` or a
    Qwen2), o, gate/up/down, two norms per layer, the final norm, the head, one embedding row."""
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    bias = q + 2 * kv if (getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2") else 0
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * f + bias + 2 * h
    weights = layers * per_layer + h + cfg.vocab_size * h + h
    return int(weights * bytes_per_weight)


_IDS = itertools.count()


def drive(llm: Any, reqs: list[tuple[list[int], int]], budget_s: float) -> tuple[int, float, int]:
    """All requests at once through the engine's step loop (as LLM.generate does), greedy,
    EOS ignored, until done or `budget_s`: (output tokens produced, seconds, requests done);
    the unfinished are aborted."""
    from dolmus import SamplingParams

    engine = llm.engine
    batch = next(_IDS)
    ids = [f"gc{batch}-{i}" for i in range(len(reqs))]
    start = time.perf_counter()
    for rid, (prompt, out_len) in zip(ids, reqs):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True), 0)
    produced: dict[str, int] = {}
    done: set[str] = set()
    while len(done) < len(ids) and time.perf_counter() - start < budget_s:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done.add(out.request_id)
    elapsed = time.perf_counter() - start
    for rid in set(ids) - done:
        engine.abort_request(rid)
    return sum(produced.values()), elapsed, len(done)


class StepTimer:
    """Wall time of an engine's scheduling, runner and update calls, by wrapping those bound
    methods on the instances (undone by `restore`)."""

    PARTS = (
        ("scheduler", "schedule"),
        ("executor", "execute"),
        ("executor", "launch"),  # async scheduling's steps
        ("scheduler", "update"),
    )

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.seconds = {f"{o}.{m}": 0.0 for o, m in self.PARTS}
        for owner, method in self.PARTS:
            target = getattr(engine, owner)
            setattr(target, method, self._wrap(getattr(target, method), f"{owner}.{method}"))
        self._launched_result = None
        try:  # async scheduling: the wait for a launched step's tokens (the host idles)
            from dolmus.runtime.inflight import LaunchedStep
        except ImportError:
            return
        self._launched_result = LaunchedStep.result
        self.seconds["wait for tokens"] = 0.0
        LaunchedStep.result = self._wrap(LaunchedStep.result, "wait for tokens")  # type: ignore[method-assign]

    def _wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0

        return timed

    def restore(self) -> None:
        for owner, method in self.PARTS:
            vars(getattr(self.engine, owner)).pop(method, None)
        if self._launched_result is not None:
            from dolmus.runtime.inflight import LaunchedStep

            LaunchedStep.result = self._launched_result  # type: ignore[method-assign]


def gpu_busy(prof: Any) -> tuple[float, int, dict[str, tuple[float, int]]]:
    """From a torch.profiler run: seconds during which some GPU activity ran (union of the
    intervals of kernels, copies and sets), how many there were, and per kernel name its
    seconds and launches.
    Reads Kineto's raw events (building FunctionEvents for every CPU op takes long)."""
    cuda = torch.autograd.DeviceType.CUDA
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]
        # GPU-side spans of annotations (gpu_user_annotation) or syncs cover gaps: work only
        spans = [
            (e.name(), e.start_ns() / 1e9, e.end_ns() / 1e9)
            for e in events
            if not any(word in e.activity_type() for word in ("annotation", "sync", "overhead"))
        ]
    except AttributeError:
        spans = [
            (e.name, e.time_range.start / 1e6, e.time_range.end / 1e6)
            for e in prof.events()
            if getattr(e, "device_type", None) == cuda
        ]
    by_name: dict[str, tuple[float, int]] = {}
    busy, last = 0.0, float("-inf")
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        secs, calls = by_name.get(name, (0.0, 0))
        by_name[name] = (secs + end - start, calls + 1)
        if end > last:
            busy += end - max(start, last)
            last = end
    return busy, len(spans), by_name


def runtime_calls(prof: Any) -> dict[str, tuple[float, int]]:
    """From a torch.profiler run: the host's CUDA runtime and driver calls (cudaLaunchKernel,
    cudaMemcpyAsync, cudaEventSynchronize...) by name: seconds and count. A call that waits
    for the device (a sync, a blocking copy) stands out by its time."""
    out: dict[str, tuple[float, int]] = {}
    try:
        events = list(prof.profiler.kineto_results.events())
    except AttributeError:
        return out
    for e in events:
        name = e.name()
        if e.device_type() == torch.autograd.DeviceType.CUDA or not name.startswith("cu"):
            continue
        secs, n = out.get(name, (0.0, 0))
        out[name] = (secs + (e.end_ns() - e.start_ns()) / 1e9, n + 1)
    return out


def pytest_stand_in() -> None:
    """tests/conftest.py and the test modules import pytest for their fixture decorators; where
    it is not installed, a stand-in whose decorators return the function lets us import their
    config builders (we never run a test or a fixture)."""
    try:
        import pytest  # noqa: F401
    except ImportError:

        class _Decorators:
            def __getattr__(self, name: str) -> Any:
                return self

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                if len(args) == 1 and callable(args[0]) and not kwargs:
                    return args[0]
                return self

        sys.modules["pytest"] = _Decorators()  # type: ignore[assignment]


def use_wheels(folder: Path, target: Path) -> list[str]:
    """The wheels benchmarks/gpu_wheels.sh left in `folder` whose distribution this Python
    lacks, unpacked into `target` (all that installing a wheel does for importing it; no pip
    needed) and put on the path, of this process and of the processes it starts."""
    from importlib.metadata import PackageNotFoundError, version

    used = []
    for wheel in sorted(folder.glob("*.whl")):
        name = wheel.name.split("-")[0]
        try:
            version(name)
            continue  # the image's own copy wins
        except PackageNotFoundError:
            pass
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        used.append(wheel.name)
    if used:
        sys.path.append(str(target))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), str(target)) if p
        )
    return used

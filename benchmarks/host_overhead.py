"""Host overhead per decode step: everything the engine does around the model's forward pass.

On a GPU a small model's decode step at batch 64 takes about a millisecond of device time
with CUDA graphs, so the host's work per step (schedule, build the inputs, sample, check
stops, detokenize, build outputs) must stay under that or it starves the device. That work
is pure Python and CPU, so it is measured here on the CPU with a model whose compute is
negligible: Llama-shaped, 2 layers, hidden 128, int8 weights (so the fused decode step, the
CPU's counterpart of the CUDA graph, runs the decode steps), random weights, and a real
tokenizer with a realistic vocabulary: SmolLM2's (49,152 byte-level BPE tokens, from the GGUF
in ../shared/models), or a 32,000-word word-level one where that file is absent.

B concurrent greedy requests (~100-token prompts, 256 new tokens or --new-tokens, EOS
ignored) run on one thread the way the engine core's process runs them: a step
(Engine.step_groups), then the message it sends the API server (core_proc.step_message: each
request's delta and a stats snapshot, msgpack-encoded). The engine's methods are wrapped from
the outside (no timing code in the engine) and every decode-only step at batch B is split into:
  model     the fused decode step / the modules' forward, and the LM head (compute_logits)
  sampler   Sampler.__call__ (its argmax over [B, vocab] is device work on a GPU)
  runner    the rest of executor.execute: the diff, inputs, row bookkeeping
  schedule  Scheduler.schedule        update  Scheduler.update (append, stop checks)
  detok     IncrementalDetokenizer.add_tokens      outputs  core_proc.step_message
  engine    the rest of Engine.step_groups
  gc        cyclic garbage collections (inside the parts above, whose times include them)
"host" is everything but model; "host-smp" also leaves out the sampler, whose greedy path is
almost all its argmax kernel (printed alone on the same logits shape as "argmax"): that is
device work on a GPU, so host-smp is what a GPU leaves on the host. "smp-cpu" is the same
by this thread's CPU time (time.thread_time) rather than wall time: what to compare when other
processes share the CPU (the parts are wall time, and the timers add ~0.5 us a call).
The CPU pressure over each run (share of time some task waited for a CPU, from
/proc/pressure/cpu) is printed, and runs over 5% are flagged as disturbed.

    python benchmarks/host_overhead.py [--batches 1,16,64] [--rounds 3] [--new-tokens 256]
                                       [--modules] [--async-scheduling]
                                       [--profile 64]   # cProfile top functions at that batch
    py-spy record -r 1000 --format raw -o out.txt -- python benchmarks/host_overhead.py --bare
Two versions of the engine compare by running this script with PYTHONPATH at each checkout in
turn (interleaved, several times; the minimum per column is the least disturbed).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import cProfile
import gc
import io
import itertools
import pstats
import random
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CACHE = Path(os.environ.get("DOLMUS_BENCH_CACHE", Path.home() / ".cache" / "dolmus-bench"))
SMOLLM_GGUF = (
    Path(__file__).resolve().parents[2]
    / "shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
)
PROMPT_TOKENS = 100
PARTS = ("model", "sampler", "runner", "schedule", "update", "detok", "outputs", "engine", "gc")


def model_dir() -> Path:
    """A tiny random Llama with a realistic tokenizer (built once and cached)."""
    real = SMOLLM_GGUF.exists()
    folder = CACHE / ("host-overhead-llama-" + ("smollm2-tok" if real else "word32k"))
    if (folder / "config.json").exists():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if real:
        from dolmus.runtime.gguf_loader import gguf_tokenizer

        tok = gguf_tokenizer(SMOLLM_GGUF)
        vocab = len(tok)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = 32000
        words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        words.decoder = decoders.WordPiece(prefix="##")
        tok = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w2")
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


class CpuPressure:
    """Fraction of wall time during which some runnable task waited for a CPU."""

    def __enter__(self) -> CpuPressure:
        self.t0, self.p0 = time.monotonic(), self._total()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = (self._total() - self.p0) / 1e6 / max(time.monotonic() - self.t0, 1e-9)

    @staticmethod
    def _total() -> int:
        try:
            with open("/proc/pressure/cpu") as f:
                return int(f.readline().split()[-1].split("=")[1])
        except OSError:
            return 0


class CoreLoop:
    """Runs requests as the engine core's process does: a step, then its one message."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def one_pass(self) -> list[Any]:
        """One step and its message (what the timers measure); the groups it moved on."""
        from dolmus.engine import core_proc

        groups = self.engine.step_groups()
        core_proc.step_message(self.engine, groups, [], 0)
        return groups

    def run(self, prompts: list[list[int]], params: Any) -> list[int]:
        """Each request's output length, in order."""
        lengths: dict[str, int] = {}
        ids = [f"r{next(_request_ids)}" for _ in prompts]
        for rid, prompt in zip(ids, prompts):
            self.engine.add_request(rid, prompt, params)
        while self.engine.has_unfinished_requests():
            for group in self.one_pass():  # checked outside the timed pass
                if group.finished:
                    lengths[group.request_id] = len(group.children[0].output_token_ids)
        return [lengths[rid] for rid in ids]


_request_ids = itertools.count()


class StepTimer:
    """Wraps the engine's methods from the outside and splits each decode-only step."""

    def __init__(self, core: CoreLoop) -> None:
        from dolmus.engine import core_proc
        from dolmus.engine.detokenizer import IncrementalDetokenizer
        from dolmus.runtime.sampler import Sampler

        self.acc: dict[str, float] = defaultdict(float)
        self.steps: dict[int, list[dict[str, float]]] = defaultdict(list)  # batch -> per-step parts
        self._batch: int | None = None
        self._undo: list[Callable[[], None]] = []
        engine = core.engine
        runner = engine.runner
        self._wrap(core, "one_pass", "step")
        self._wrap(engine.scheduler, "schedule", "schedule", self._note_plan)
        self._wrap(engine.scheduler, "update", "update")
        self._wrap(engine.executor, "execute", "execute")
        self._wrap(engine.executor, "launch", "execute")  # async scheduling's steps
        self._wrap(core_proc, "step_message", "outputs")
        self._wrap(runner.model, "forward", "model")
        self._wrap(runner.model, "compute_logits", "model")
        if runner.fused_decoder is not None:
            self._wrap(runner.fused_decoder, "run", "model")
        self._wrap(Sampler, "__call__", "sampler", on_class=True)
        self._wrap(Sampler, "sample_tensor", "sampler", on_class=True)
        self._wrap(IncrementalDetokenizer, "add_tokens", "detok", on_class=True)
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)
        self._undo.append(lambda: gc.callbacks.remove(self._on_gc))

    def _on_gc(self, phase: str, info: dict) -> None:
        """Cyclic garbage collections, which run inside whatever part allocated last."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.acc["gc"] += time.perf_counter() - self._gc_start

    def _wrap(
        self,
        obj: Any,
        name: str,
        key: str,
        after: Callable[[Any], None] | None = None,
        on_class: bool = False,
    ) -> None:
        original = getattr(obj, name)
        acc = self.acc
        clock = time.perf_counter

        cpu = time.thread_time
        if on_class and key == "sampler":  # one call a step: its CPU time as well

            def timed(this: Any, *args: Any, **kwargs: Any) -> Any:
                t, c = clock(), cpu()
                try:
                    return original(this, *args, **kwargs)
                finally:
                    acc[key] += clock() - t
                    acc[key + "_cpu"] += cpu() - c

        elif on_class:

            def timed(this: Any, *args: Any, **kwargs: Any) -> Any:
                t = clock()
                try:
                    return original(this, *args, **kwargs)
                finally:
                    acc[key] += clock() - t

        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                t, c = clock(), cpu()
                try:
                    out = original(*args, **kwargs)
                finally:
                    acc[key] += clock() - t
                    acc[key + "_cpu"] += cpu() - c
                if after is not None:
                    after(out)
                return out

        if key == "step":
            timed = self._step_wrapper(original)
        own = name in vars(obj)
        setattr(obj, name, timed)
        if on_class or own:  # a class's or a module's own attribute: put it back
            self._undo.append(lambda: setattr(obj, name, original))
        else:  # an instance's bound method: drop the shadowing attribute
            self._undo.append(lambda: obj.__dict__.pop(name, None))

    def _step_wrapper(self, original: Callable[[], Any]) -> Callable[[], Any]:
        def step() -> Any:
            self.acc.clear()
            self._batch = None
            t, c = time.perf_counter(), time.thread_time()
            out = original()
            total = time.perf_counter() - t
            total_cpu = time.thread_time() - c
            if self._batch is not None:
                a = self.acc
                parts = {
                    k: a[k] for k in ("model", "sampler", "schedule", "update", "detok", "outputs", "gc")
                }
                parts["runner"] = a["execute"] - a["model"] - a["sampler"]
                parts["engine"] = (
                    total - a["execute"] - a["schedule"] - a["update"] - a["detok"] - a["outputs"]
                )
                parts["total"] = total
                parts["cpu"] = total_cpu - a["model_cpu"] - a["sampler_cpu"]
                self.steps[self._batch].append(parts)
            return out

        return step

    def _note_plan(self, sched: Any) -> None:
        plan = sched.plan
        decode_only = (
            not plan.new_requests
            and not plan.draft_token_ids
            and plan.num_scheduled_tokens
            and all(n == 1 for n in plan.num_scheduled_tokens.values())
        )
        self._batch = len(plan.num_scheduled_tokens) if decode_only else None

    def close(self) -> None:
        for undo in reversed(self._undo):
            undo()


def argmax_ms(batch: int, vocab: int, reps: int = 50) -> float:
    """The sampler's greedy kernel alone on bf16 logits [batch, vocab] (device work on a GPU)."""
    logits = torch.randn(batch, vocab).to(torch.bfloat16)
    logits.max(dim=-1)
    t = time.perf_counter()
    for _ in range(reps):
        logits.max(dim=-1).indices.tolist()
    return (time.perf_counter() - t) / reps * 1e3


def requests(batch: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(100, vocab) for _ in range(PROMPT_TOKENS + rng.randrange(-8, 9))] for _ in range(batch)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request")
    ap.add_argument("--modules", action="store_true", help="decode through the modules, not the fused step")
    ap.add_argument("--profile", type=int, default=0, help="also profile one run at this batch (cProfile)")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="steps launched ahead as on a GPU (on the CPU the same bookkeeping, no overlap)",
    )
    ap.add_argument(
        "--bare", action="store_true", help="no timers: only run the batches (under py-spy record)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dolmus import LLM, SamplingParams

    folder = model_dir()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        model=str(folder),
        dtype="bfloat16",
        quantization="int8",
        num_threads=1,
        max_num_seqs=max(batches),
        fused_decode=not args.modules,
        async_scheduling=args.async_scheduling,
    )
    runner = llm.engine.runner
    vocab = llm.engine.model_config.vocab_size
    core = CoreLoop(llm.engine)
    new_tokens = args.new_tokens
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(requests(4, vocab, 0), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    path = "fused decode step" if runner.fused_decoder is not None else "modules"
    print(
        f"torch {torch.__version__}, 1 thread, tokenizer vocab {vocab} "
        f"({type(llm.tokenizer).__name__}), {path}"
    )
    print("ms per decode-only step (mean over the steps at that batch; model excluded from host)")
    head = "".join(f"{p:>9}" for p in PARTS)
    print(
        f"{'batch':>5}{'round':>6}{head}{'host':>9}{'host-smp':>9}{'argmax':>9}{'smp-cpu':>9}  cpu pressure"
    )
    for batch in batches:
        if args.bare:
            for r in range(args.rounds):
                core.run(requests(batch, vocab, 1000 * r + batch), params)
            continue
        kernel = argmax_ms(batch, vocab)
        for r in range(args.rounds):
            timer = StepTimer(core)
            try:
                with CpuPressure() as pressure:
                    lengths = core.run(requests(batch, vocab, 1000 * r + batch), params)
            finally:
                timer.close()
            assert lengths == [new_tokens] * batch
            steps = timer.steps[batch][2:]  # the first steps warm caches up
            mean = {k: statistics.fmean(s[k] for s in steps) * 1e3 for k in (*PARTS, "total", "cpu")}
            host = mean["total"] - mean["model"]
            flag = "  (disturbed)" if pressure.share > 0.05 else ""
            values = [mean[p] for p in PARTS] + [host, host - mean["sampler"], kernel, mean["cpu"]]
            cols = "".join(f"{v:>9.3f}" for v in values)
            print(f"{batch:>5}{r:>6}{cols}  {pressure.share:.1%}{flag}", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prompts = requests(args.profile, vocab, 7)
        with CpuPressure() as pressure:
            prof.enable()
            core.run(prompts, params)
            prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"cProfile of one run at batch {args.profile} (cpu pressure {pressure.share:.1%}):")
        print(out.getvalue())


if __name__ == "__main__":
    main()

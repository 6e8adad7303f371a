"""Tiny test fixtures and reference runs for gpu_check.py: the tests' model builders (imported
from tests/, with a pytest stand-in where pytest is absent), transformers' greedy tokens and
its padded-batch throughput, dolmus' batch-1 decode rate, and nano-vllm's benchmark workload."""

from __future__ import annotations

import dataclasses
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from gpu_check_lib import copy_bandwidth, free_memory, pytest_stand_in, say
from offline_throughput import qwen05b_shape_dir


def fixture_builders(quick: bool) -> list[tuple[str, Any]]:
    """(name, build(folder) -> folder) for every tiny test fixture, reusing the tests' builders."""
    pytest_stand_in()
    import conftest

    import helpers

    def dense(arch: str) -> Any:
        return lambda folder: conftest.build_model_dir(arch, folder.parent)  # builds parent/arch

    def gemma3(folder: Path) -> Path:
        import test_gemma3  # its fixture, less pytest: norms moved off zero so they matter
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(test_gemma3._config(), dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.5)
        model.save_pretrained(folder)
        for name in conftest.TOKENIZER_FILES:
            shutil.copy(conftest.DEFAULT_MODEL_DIR / name, folder / name)
        return folder

    def swa(kind: str) -> Any:
        import test_sliding_window

        return lambda folder: test_sliding_window._build(kind, folder.parent / "swa")

    def deepseek(kind: str) -> Any:
        import test_deepseek

        return lambda folder: test_deepseek.build_deepseek_dir(kind, folder)

    builders = [(arch, dense(arch)) for arch in conftest.ARCHS]
    builders += [
        (m, lambda f, m=m: helpers.build_moe_dir(m, f)) for m in ("mixtral", "qwen2_moe", "qwen3_moe")
    ]
    builders += [("gemma3", gemma3), ("swa-mistral", swa("mistral")), ("swa-qwen2-mixed", swa("qwen2-mixed"))]
    builders += [("deepseek-v2", deepseek("v2")), ("deepseek-v3", deepseek("v3"))]
    if quick:
        return [b for b in builders if b[0] in ("llama", "qwen2_moe", "gemma3")]
    return builders


@torch.inference_mode()
def hf_greedy_on(folder: Path, prompts: list[list[int]], new: int, device: torch.device) -> list[list[int]]:
    """transformers' greedy generate, float32, each prompt alone, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(out[0, len(prompt) :].tolist())
    del model
    return outs


def batch1_rate(llm: Any, vocab: int, new: int, seed: int) -> float:
    """Decode tok/s of one request: 1 / its time per output token after the first."""
    from dolmus import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(32)]
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0].outputs[0]
    wall = time.perf_counter() - t0
    if out.metrics is not None and out.metrics.tpot:
        return 1.0 / out.metrics.tpot
    return len(out.token_ids) / wall


def nano_vllm_workload(quick: bool, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    count, low, high = (8, 10, 40) if quick else (256, 100, 1024)
    specs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(count)]
    return [([rng.randrange(3, vocab) for _ in range(p)], o) for p, o in specs]


@torch.inference_mode()
def hf_throughput(
    folder: Path, reqs: list[tuple[list[int], int]], device: torch.device, max_time: float
) -> tuple:
    """transformers' generate, bf16, one left-padded batch; counts each request's own output
    length (as far as the batch got) as useful tokens: (tok/s, steps, seconds)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(torch.ones(2, 8, dtype=torch.long, device=device), max_new_tokens=4, **kw)  # warm-up
    width = max(len(p) for p, _ in reqs)
    ids = torch.zeros(len(reqs), width, dtype=torch.long)
    mask = torch.zeros(len(reqs), width, dtype=torch.long)
    for j, (p, _) in enumerate(reqs):
        ids[j, width - len(p) :] = torch.tensor(p)
        mask[j, width - len(p) :] = 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max(o for _, o in reqs),
        max_time=max_time,
        **kw,
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    steps = out.shape[1] - width
    del model, out
    return sum(min(o, steps) for _, o in reqs) / seconds, steps, seconds


GiB = 2**30
# label -> engine options beyond bf16 (section 3 builds them, sections 4 and 5 reuse them)
FORMATS = {
    "bf16 graphs": {},  # async scheduling on (the CUDA default)
    "bf16 sync": {"async_scheduling": False},  # graphs, steps one at a time
    "bf16 eager": {"enforce_eager": True},
    "fp8 graphs": {"quantization": "fp8"},
    "int4 graphs": {"quantization": "int4"},
}


@dataclasses.dataclass
class Ctx:
    device: torch.device
    quick: bool  # the hidden CPU plumbing check: tiny models, a few requests
    root: Path  # the tiny fixtures' folders
    bandwidth: float | None = None
    idle_batches: tuple[int, ...] = (64,)  # section 5's decode batch sizes
    engines: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: set[str] = dataclasses.field(default_factory=set)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def llm(self, model: Path | str, **options: Any) -> Any:
        """An LLM on this device; options this build's EngineConfig lacks are dropped, once said."""
        from dolmus import LLM, EngineConfig

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        for name in set(options) - known:
            if name not in self.notes:
                self.notes.add(name)
                say(f"note: this build has no EngineConfig.{name}: runs ignore it", f"note: no {name}")
        kept = {k: v for k, v in options.items() if k in known}
        return LLM(model=str(model), device=str(self.device), **kept)

    def big_model(self) -> Path:
        if self.quick:
            from conftest import build_model_dir

            return build_model_dir("qwen2", self.root)
        return qwen05b_shape_dir()

    def engine(self, label: str) -> Any:
        if label not in self.engines:
            t0 = time.perf_counter()
            self.engines[label] = self.llm(
                self.big_model(),
                dtype="bfloat16",
                max_num_seqs=16 if self.quick else 256,
                kv_cache_memory=64 * 2**20 if self.quick else 12 * GiB,
                **FORMATS[label],
            )
            runner = getattr(self.engines[label].engine.executor, "runner", None)
            backend = type(getattr(runner, "attention", None)).__name__
            say(f"  ({label}: engine ready in {time.perf_counter() - t0:.1f} s, attention {backend})")
        return self.engines[label]

    def drop_engines(self) -> None:
        for llm in self.engines.values():
            llm.engine.shutdown()
        self.engines.clear()
        free_memory(self.device)

    def measured_bandwidth(self) -> float:
        if self.bandwidth is None:
            self.bandwidth = copy_bandwidth(self.device, 2**26 if self.quick else GiB)
        return self.bandwidth

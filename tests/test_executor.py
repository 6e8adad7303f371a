"""Worker-process executors: the same tokens as in-process, and a dead worker is an error, not a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dolmus import LLM, SamplingParams
from dolmus.executor import WorkerDiedError

PROMPTS = ["Once upon a time", "The cat sat on the mat and", "Lily", "Once upon a time there was"]
# A small KV pool and step budget: prefix hits, chunked prefill and preemption all happen.
TIGHT = dict(
    dtype="float32",
    kv_cache_memory=20 * 16 * 512,
    block_size=16,  # 20 blocks of 16 tokens
    max_num_batched_tokens=32,
    max_num_seqs=4,
)


def _tokens(llm: LLM) -> list[list[int]]:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    seeded = llm.generate(PROMPTS, SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=30))
    return [c.token_ids for o in greedy + seeded for c in o.outputs]


def test_worker_process_gives_the_in_process_tokens(llama_dir):
    inproc = LLM(str(llama_dir), **TIGHT)
    want = _tokens(inproc)
    assert inproc.engine.stats().num_preemptions > 0  # the crossing with preemption is exercised
    worker = LLM(str(llama_dir), executor="mp", **TIGHT)
    try:
        assert _tokens(worker) == want
        assert worker.engine.stats().weight_bytes == inproc.engine.stats().weight_bytes
        # Scoring crosses the process line too.
        ids = inproc.tokenizer.encode("Once upon a time there was a cat")
        assert torch.allclose(worker.engine.prompt_logprobs(ids), inproc.engine.prompt_logprobs(ids))
    finally:
        worker.engine.shutdown()


def test_a_killed_worker_fails_the_engine_instead_of_hanging(llama_dir):
    llm = LLM(str(llama_dir), executor="mp", dtype="float32")
    executor = llm.engine.executor
    try:
        assert llm.engine.is_healthy()
        os.kill(executor._procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while llm.engine.is_healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.is_healthy()  # seen while idle, before any step runs
        errors: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate("Once upon a time", SamplingParams(max_tokens=5))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        thread.join(timeout=30)
        assert not thread.is_alive(), "a step hung on a dead worker"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
        assert "dolmus-worker-0" in str(errors[0]) and "-9" in str(errors[0])
    finally:
        executor.shutdown()


def test_a_worker_that_cannot_load_reports_why(llama_dir):
    with pytest.raises(ValueError, match="holds no block"):
        LLM(str(llama_dir), executor="mp", dtype="float32", kv_cache_memory=100)

"""Tensor parallelism over torch.distributed: TP=2 gives TP=1's tokens on every architecture,
with the engine's features crossed (prefix hits, chunked prefill, preemption, seeded n=4,
speculative decoding), and a rank that dies or hangs ends the engine with a clear error in
bounded time."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
import torch
from server_helpers import RemoteServer

from dolmus import LLM, SamplingParams
from dolmus.config import ModelConfig
from dolmus.executor import WorkerDiedError
from dolmus.step import StepPlan

SYSTEM = "Once upon a time there was a little girl named Lily who lived in a small house. "
PROMPTS = [SYSTEM + "She liked", SYSTEM + "One day she", "The cat sat on the mat and", SYSTEM + "Lily"]
# A small step budget and (below) KV pool: prefix hits, chunked prefill and preemption all happen.
TIGHT = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)


def _tight(folder, tp: int = 1) -> dict:
    """TIGHT with a pool of 16 blocks of 16 tokens on each of `tp` ranks (the budget is the
    host's, split between its ranks), whatever the model's KV size per token."""
    cfg = ModelConfig.from_dir(folder)
    kv_heads = max(1, cfg.num_kv_heads // tp)  # a rank's share, or the one KV head it shares
    per_token = cfg.num_layers * 2 * kv_heads * cfg.head_dim * 4  # float32 keys and values
    return {**TIGHT, "kv_cache_memory": tp * 16 * 16 * per_token}


def _tokens(llm: LLM) -> list[list[int]]:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    seeded = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=4, max_tokens=24))
    return [c.token_ids for o in greedy + seeded for c in o.outputs]


@pytest.fixture
def tp2(request: pytest.FixtureRequest):
    """Engines with tensor_parallel_size=2 made by a test, shut down after it."""
    made: list[LLM] = []

    def make(*args, **kwargs) -> LLM:
        llm = LLM(*args, tensor_parallel_size=2, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.shutdown()


def test_two_ranks_give_one_ranks_tokens_and_logprobs(model_dir, tp2) -> None:
    one = LLM(str(model_dir), **_tight(model_dir))
    want = _tokens(one)
    stats = one.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the crossings happen
    two = tp2(str(model_dir), **_tight(model_dir, 2))
    assert _tokens(two) == want
    assert two.engine.stats().num_preemptions > 0
    ids = one.tokenizer.encode(PROMPTS[0])
    torch.testing.assert_close(
        two.engine.prompt_logprobs(ids), one.engine.prompt_logprobs(ids), atol=1e-4, rtol=0
    )
    # Each rank holds half the KV heads of every layer (or the one they share), the same blocks.
    cfg = ModelConfig.from_dir(model_dir)
    share = 2 if cfg.num_kv_heads > 1 else 1
    assert two.engine.executor.info.kv_bytes_per_token * share == one.engine.executor.info.kv_bytes_per_token
    assert two.engine.executor.info.num_blocks == one.engine.executor.info.num_blocks == 16


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_speculative_decoding_under_tensor_parallelism_keeps_the_tokens(llama_dir, tp2, speculative) -> None:
    if speculative["method"] == "draft_model":
        speculative = {**speculative, "model": str(llama_dir)}  # the target as its own draft
    roomy = {**TIGHT, "kv_cache_memory": 16 * 2**20}  # the draft's pool shares it: no length cap
    want = _tokens(LLM(str(llama_dir), **roomy))
    two = tp2(str(llama_dir), speculative_config=speculative, **roomy)
    assert _tokens(two) == want
    stats = two.engine.stats()
    assert stats.spec_num_draft_tokens > 0  # windows were verified across the ranks
    if speculative["method"] == "draft_model":
        assert stats.spec_num_accepted_tokens > 0


def _generate_in_thread(llm: LLM) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(PROMPTS * 4, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    return thread, errors


def _wait_for_steps(llm: LLM) -> None:
    deadline = time.monotonic() + 60
    while llm.engine.stats().generation_tokens < 8 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_killed_rank_fails_the_engine_instead_of_hanging(llama_dir, tp2) -> None:
    llm = tp2(str(llama_dir), dtype="float32")
    thread, errors = _generate_in_thread(llm)
    _wait_for_steps(llm)
    os.kill(llm.engine.executor._procs[1].pid, signal.SIGKILL)
    thread.join(timeout=60)
    assert not thread.is_alive(), "a step hung on a dead rank"
    assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
    assert "dolmus-worker-1" in str(errors[0]) or "rank" in str(errors[0])
    assert not llm.engine.is_healthy()


def test_a_hung_rank_fails_the_engine_within_the_distributed_timeout(llama_dir, tp2) -> None:
    llm = tp2(str(llama_dir), dtype="float32", distributed_timeout=5)
    thread, errors = _generate_in_thread(llm)
    _wait_for_steps(llm)
    stopped = llm.engine.executor._procs[1].pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a step waited past the distributed timeout"
        assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError)
        assert "in 5 s" in str(errors[0]) or "failed the step" in str(errors[0])
    finally:
        os.kill(stopped, signal.SIGCONT)


def test_a_rank_that_raises_fails_the_engine_with_its_traceback(llama_dir, tp2) -> None:
    """A plan the runners cannot follow (a request they never saw) raises on every rank: the
    engine learns it from the first rank's answer, not from a collective that never ends."""
    llm = tp2(str(llama_dir), dtype="float32")
    with pytest.raises(WorkerDiedError, match=r"(?s)failed the step.*rank \d.*KeyError: 'never-added'"):
        llm.engine.executor.execute(StepPlan(num_scheduled_tokens={"never-added": 1}))
    assert not llm.engine.is_healthy()


def test_bad_parallel_settings_are_refused(llama_dir) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(llama_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="nnodes must be >= 1 and divide"):
        LLM(str(llama_dir), tensor_parallel_size=2, nnodes=3, master_port=29500)
    with pytest.raises(ValueError, match="master_port is needed"):
        LLM(str(llama_dir), tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="run `dolmus worker`"):
        LLM(str(llama_dir), tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(
        ValueError, match=r"rank \d: num_\w+_heads \(\d\) (does not split evenly|neither splits)"
    ):
        LLM(str(llama_dir), tensor_parallel_size=3, dtype="float32")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: no extra package)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_pids(server_pid: int) -> list[int]:
    pids = []
    for pid in _descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        with open(f"/proc/{pid}/status") as f:
            ppid_line = next(line for line in f if line.startswith("PPid:"))
        if b"spawn_main" in cmdline and int(ppid_line.split()[1]) != server_pid:
            pids.append(pid)  # a worker (the engine core is the server's own spawned child)
    return pids


def test_served_with_two_ranks_then_a_dead_rank_turns_health_503(llama_dir) -> None:
    args = ("--model", str(llama_dir), "--dtype", "float32", "--tensor-parallel-size", "2")
    want = (
        LLM(str(llama_dir), dtype="float32")
        .generate("Once upon a time", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    with RemoteServer(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        answer = client.completions.create(
            model=str(llama_dir),
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert answer.choices[0].text == want
        ranks = _rank_pids(server.proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(0.2)
            status = httpx.get(f"{server.url}/health", timeout=10).status_code
        assert status == 503
        with pytest.raises(openai.APIStatusError):
            client.with_options(max_retries=0).completions.create(
                model=str(llama_dir), prompt="Lily", max_tokens=4
            )


def test_gguf_blocks_split_on_block_boundaries_under_tensor_parallelism(model_root, tp2, tmp_path) -> None:
    """Q4_0 codes as stored: each rank takes whole blocks of the row-parallel layers' inputs,
    whole rows elsewhere (the Qwen2 fixture's one KV head on both ranks, its tied head's codes)."""
    from conftest import build_model_dir

    from dolmus.convert import convert_to_gguf

    gguf = convert_to_gguf(str(build_model_dir("qwen2", model_root)), str(tmp_path / "q4_0.gguf"), "q4_0")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(gguf), dtype="float32").generate(PROMPTS, params)]
    got = [o.outputs[0].token_ids for o in tp2(str(gguf), dtype="float32").generate(PROMPTS, params)]
    assert got == want

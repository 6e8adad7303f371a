"""Sliding-window attention over the paged KV cache: Mistral (every layer windowed) and Qwen2
with `use_sliding_window` (every layer, and a mix of windowed and full layers), prompts and
generations longer than the window. Greedy tokens and logprobs equal transformers'; chunked
prefill, prefix hits and preemption keep the tokens; a long request holds at most the
window's blocks plus two."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import TOKENIZER_FILES

from dolmus import LLM
from dolmus.config import DEFAULT_MODEL_DIR
from tests.helpers import greedy, hf_greedy, hf_logprobs, random_prompts, run_tokens

WINDOW = 24
BLOCK = 4  # small blocks, so a request gives some back early
LENGTHS = (5, 30, 70)
NEW = 40  # generation runs well past the window


def _config(kind: str):
    from transformers import MistralConfig, Qwen2Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.15,  # decisive greedy choices (conftest.py)
        sliding_window=WINDOW,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "mistral":
        return MistralConfig(**common)
    # "qwen2": every layer windowed; "qwen2-mixed": layer 0 full, layer 1 windowed
    return Qwen2Config(**common, use_sliding_window=True, max_window_layers=0 if kind == "qwen2" else 1)


def _build(kind: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM

    folder = root / kind
    if not folder.exists():
        torch.manual_seed(7)
        AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).save_pretrained(folder)
        for name in TOKENIZER_FILES:  # the built-in model's 512-token vocabulary
            shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def swa_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("swa")


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen2-mixed"])
def swa_dir(request: pytest.FixtureRequest, swa_root: Path) -> Path:
    return _build(request.param, swa_root)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_equal_transformers(swa_dir: Path, backend: str) -> None:
    prompts = random_prompts(LENGTHS, seed=11)
    llm = LLM(str(swa_dir), dtype="float32", block_size=BLOCK, attention_backend=backend)
    assert llm.engine.max_model_len == 512  # not capped at the window
    assert run_tokens(llm, prompts, greedy(NEW)) == [hf_greedy(swa_dir, p, NEW) for p in prompts]
    ids = prompts[-1]
    theirs = hf_logprobs(swa_dir, ids)
    # whole prompt at once, chunks reading earlier ones from the cache, and one token at a time
    for chunk in (None, 9, 1):
        ours = llm.engine.prompt_logprobs(ids, chunk_size=chunk)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_chunked_prefill_prefix_hits_and_preemption_keep_the_tokens(swa_dir: Path) -> None:
    head = random_prompts((40,), seed=12)[0]  # a shared head longer than the window
    prompts = random_prompts((20, 33, 7, 60), seed=13, prefix=head)
    expected = [hf_greedy(swa_dir, p, NEW) for p in prompts]
    # 2 KV heads x 16 dims x 2 (K, V) x 4 bytes x 2 layers: 512 bytes per token. Windowed
    # requests each hold at most 11 blocks of 4 here; a mixed model's hold a whole request.
    blocks = 40 if swa_dir.name == "qwen2-mixed" else 16
    tight = LLM(
        str(swa_dir),
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=16,
        kv_cache_memory=512 * BLOCK * blocks,
    )
    assert run_tokens(tight, prompts, greedy(NEW)) == expected
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_a_long_request_holds_only_its_window(swa_root: Path) -> None:
    """Every layer windowed: blocks behind the window go back to the pool as the request runs
    (a mixed model keeps them all: its full layers read everything)."""
    bound = -(-WINDOW // BLOCK) + 2
    for kind, freed in (("mistral", True), ("qwen2-mixed", False)):
        llm = LLM(
            str(_build(kind, swa_root)), dtype="float32", block_size=BLOCK, max_num_batched_tokens=BLOCK
        )
        engine = llm.engine
        prompt = random_prompts((70,), seed=14)[0]
        engine.add_request("long", prompt, greedy(60))
        held = []
        while engine.has_unfinished_requests():
            engine.step()
            held.append(engine.kv.num_held_blocks("long"))
            if held[-1]:  # the pool agrees: nothing else runs
                assert engine.kv.num_used_blocks == held[-1]
        if freed:
            assert 0 < max(held) <= bound
        else:
            # every block until the end (the step that ends it frees them all at once)
            assert max(held) == -(-(70 + 60 - 2) // BLOCK)
        assert engine.kv.num_used_blocks == 0

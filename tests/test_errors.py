"""Bad input: a clear ValueError naming the field, and no harm to other requests."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dolmus import LLM, SamplingParams
from dolmus.config import DEFAULT_MODEL_DIR, EngineConfig
from dolmus.engine.engine import Engine
from helpers import greedy, random_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=128)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-1), "temperature"),
        (dict(n=0), "n"),
        (dict(top_k=-5), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_prompt(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("")
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]])


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 200])


def test_token_ids_out_of_vocab(llm):
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, 99999]])


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))


def test_unsupported_architecture(tmp_path):
    folder = tmp_path / "gpt"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(folder))


def test_missing_weights_file(tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(folder))


def test_bad_config_field(tmp_path):
    folder = tmp_path / "badcfg"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(model=str(folder))


def test_bad_engine_config():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=100000)


def test_bad_request_does_not_disturb_running_ones(llama_dir):
    prompts = random_prompts(lengths=(10, 90), seed=21)
    engine = Engine(EngineConfig(model=str(llama_dir), dtype="float32"))
    alone = LLM(model=str(llama_dir), dtype="float32").generate(prompts, greedy())
    for i, p in enumerate(prompts):
        engine.add_request(f"ok{i}", p, greedy())
    results = {}
    for step in range(60):
        if step in (3, 10):
            for bad in ("", [1] * 5000, [512]):
                with pytest.raises(ValueError):
                    engine.add_request(f"bad{step}", bad, greedy())
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("ok0", [1, 2], greedy())
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert results == {f"ok{i}": o.outputs[0].token_ids for i, o in enumerate(alone)}
    assert engine.stats().kv_blocks_used == 0


def test_abort_frees_blocks_and_spares_others(llama_dir):
    prompts = random_prompts(lengths=(40, 50), seed=22)
    engine = Engine(EngineConfig(model=str(llama_dir), dtype="float32"))
    alone = LLM(model=str(llama_dir), dtype="float32").generate(prompts[1:], greedy())
    engine.add_request("a", prompts[0], greedy())
    engine.add_request("b", prompts[1], greedy())
    for _ in range(5):
        engine.step()
    engine.abort_request("a")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == ["b"]
    assert finished["b"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.finished == {"abort": 1, "length": 1}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_gpu():
    with pytest.raises(ValueError, match="CUDA"):
        LLM(device="cuda")

"""Sampling options through the engine on the real stories260k model."""

from __future__ import annotations

import pytest
import torch

from dolmus import LLM, SamplingParams
from dolmus.runtime.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _rows(params, n=1):
    return [SamplingRow(params, None, [1], 1, []) for _ in range(n)]


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate("Once", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].token_ids
    topk1 = (
        llm.generate("Once", SamplingParams(temperature=1.5, top_k=1, max_tokens=30))[0].outputs[0].token_ids
    )
    assert topk1 == greedy


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = set()
    for _ in range(300):
        seen.add(sampler(logits.clone(), _rows(SamplingParams(top_p=0.7)))[0].token_id)
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.08, 0.02]]))
    sampler = Sampler(torch.device("cpu"), seed=0)
    seen = {sampler(logits.clone(), _rows(SamplingParams(min_p=0.2)))[0].token_id for _ in range(300)}
    assert seen == {0, 1}


def test_penalties_change_repetitive_output(llm):
    base = llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=60))[0].outputs[0]
    pen = llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=60, repetition_penalty=1.5))[
        0
    ].outputs[0]
    freq = llm.generate("The cat sat", SamplingParams(temperature=0, max_tokens=60, frequency_penalty=1.5))[
        0
    ].outputs[0]
    assert pen.token_ids != base.token_ids and freq.token_ids != base.token_ids
    assert len(set(pen.token_ids)) > len(set(base.token_ids))


def test_min_tokens_holds_eos_back():
    logits = torch.tensor([[0.0, 0.0, 10.0, 1.0]])  # EOS (2) would win
    sampler = Sampler(torch.device("cpu"), seed=0)
    row = SamplingRow(SamplingParams(temperature=0, min_tokens=3), None, [1, 5], 1, [2])
    assert sampler(logits.clone(), [row])[0].token_id == 3


def test_stop_token_ids_and_eos(llm):
    out = llm.generate("Once", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    stop_on = out.token_ids[5]
    stopped = llm.generate("Once", SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_on]))
    c = stopped[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop_on and c.token_ids[-1] == stop_on


def test_stop_string_through_engine(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=50, stop=["Lily"]))
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "Lily"
    assert c.text == ", there was a little girl named "


def test_logprobs_top_k_and_chosen(llm):
    out = llm.generate("Once", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, step in zip(out.token_ids, out.logprobs):
        assert token in step and len(step) == 3  # greedy choice is one of the top 3
        assert step[token] == max(step.values())


def test_eos_list_from_generation_config(tmp_path, llm):
    """generation_config.json's eos_token_id list ends generation on any of its ids."""
    import json
    import shutil

    from dolmus.config import DEFAULT_MODEL_DIR

    free = llm.generate("Once", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].token_ids
    folder = tmp_path / "eos"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, free[6]]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    out = LLM(model=str(folder)).generate("Once", SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert out.token_ids == free[: free.index(free[6]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = LLM(model=str(folder)).generate(
        "Once", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    assert ignored[0].outputs[0].token_ids == free


def test_processors_leave_the_callers_float32_logits_raw():
    """Penalties work in place on a float copy: float32 logits must not be that copy, or a
    grammar's redraw and the logprobs would read penalised rows (and penalise them twice)."""
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, presence_penalty=0.5)
    rows = [SamplingRow(params, None, [1, 2, 3, 4], 2, []) for _ in range(2)]
    sampler = Sampler(torch.device("cpu"), seed=0)
    sampler(logits, rows)
    assert torch.equal(logits, raw)
    probs = sampler.probabilities(logits, rows)
    assert torch.equal(logits, raw) and torch.allclose(probs.sum(-1), torch.ones(2))

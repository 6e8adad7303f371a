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


def test_top_k_top_p_keeps_what_transformers_warpers_keep():
    """A batch of rows, each through transformers' TopKLogitsWarper then TopPLogitsWarper alone:
    peaked rows (a nucleus among the candidates), flat rows (a nucleus past them: the whole
    row is sorted), rows of ties at the k-th value, k past the candidates, and untouched rows."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from dolmus.runtime.logits_processing import TRUNCATION_CANDIDATES, top_k_top_p

    vocab = 4 * TRUNCATION_CANDIDATES
    g = torch.Generator().manual_seed(0)
    shapes = {
        "peaked": lambda: torch.randn(vocab, generator=g) * 6,
        "flat": lambda: torch.randn(vocab, generator=g) * 0.3,
        "ties": lambda: torch.randint(0, 3, (vocab,), generator=g).float(),
    }
    cases = [
        (shape, k, p)
        for shape in shapes
        for k in (0, 1, 7, TRUNCATION_CANDIDATES + 40, vocab - 1)
        for p in (1.0, 0.95, 0.6)
    ]
    logits = torch.stack([shapes[shape]() for shape, _, _ in cases])
    # A batch takes as many candidates as its widest top-k: rows with k = vocab - 1 apart,
    # so that the others run on fewer candidates than the vocabulary.
    wide = torch.tensor([k == vocab - 1 for _, k, _ in cases])
    got = torch.empty_like(logits)
    for part in (wide, ~wide):
        got[part] = top_k_top_p(
            logits[part],
            [k for (_, k, _), w in zip(cases, part) if w],
            [p for (_, _, p), w in zip(cases, part) if w],
        )
    for row, (shape, k, p) in enumerate(cases):
        want = logits[row : row + 1].clone()
        if 0 < k < vocab:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1.0:
            want = TopPLogitsWarper(p)(None, want)
        if shape == "ties" and p < 1.0:
            # which of equal tokens fall inside the nucleus is the sort's choice: the same
            # values must stay, not the same positions
            assert torch.equal(got[row].sort().values, want[0].sort().values), (shape, k, p)
        else:
            assert torch.equal(got[row : row + 1], want), (shape, k, p)
    assert torch.isinf(got).sum() > 0  # not a test of rows left alone


def test_penalties_on_a_batch_match_each_row_alone():
    """Repetition (transformers' processor: every token seen, prompt included) and OpenAI's
    frequency and presence penalties (output tokens only), rows of different settings and
    lengths in one batch, ids past the vocabulary ignored."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    vocab = 64
    g = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, repetition_penalty=0.8, frequency_penalty=-0.5),
    ]
    rows = []
    for i, p in enumerate(params):
        prompt = torch.randint(0, vocab, (5 + 3 * i,), generator=g).tolist()
        output = torch.randint(0, vocab, (2 * i,), generator=g).tolist() + [vocab + 3]
        rows.append(SamplingRow(p, None, prompt + output, len(prompt), []))
    logits = torch.randn(len(rows), vocab, generator=g)
    got = logits.clone()
    Sampler._apply_processors(got, rows)
    for i, (row, p) in enumerate(zip(rows, params)):
        want = logits[i : i + 1].clone()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor([[t for t in row.token_ids if t < vocab]])
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, want)
        out = torch.tensor([t for t in row.output_ids if t < vocab], dtype=torch.long)
        counts = torch.bincount(out, minlength=vocab)
        want = want - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i : i + 1], want, rtol=0, atol=1e-6)
    assert not torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])

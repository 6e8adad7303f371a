"""The shipped real model reproduces its documented greedy text, through the API and CLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dolmus import LLM, SamplingParams
from dolmus.config import DEFAULT_MODEL_DIR


def _readme_blocks() -> list[str]:
    return re.findall(r"```\n(.*?)\n```", (DEFAULT_MODEL_DIR / "README.md").read_text(), re.S)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # no model argument: the built-in default


def test_bos_continuation_equals_readme(llm):
    story, _ = _readme_blocks()
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=80))[0].outputs[0]
    assert out.text == story
    assert len(out.token_ids) == 80


def test_the_cat_sat_equals_readme(llm):
    _, cat = _readme_blocks()
    prompt = "The cat sat"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200))[0]
    assert out.prompt_token_ids == [1, 291, 280, 294, 262, 294]
    assert (prompt + out.outputs[0].text).startswith(cat)


def test_streamed_deltas_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", "Once upon a time", SamplingParams(temperature=0, max_tokens=60))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    m = final.outputs[0].metrics
    assert len(m.itl) == 59 and all(gap >= 0 for gap in m.itl)
    assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency
    assert m.tpot is not None and m.num_preemptions == 0


def test_chat_uses_fallback_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "Tell me a story"}], SamplingParams(temperature=0, max_tokens=5)
    )
    ids = out[0].prompt_token_ids
    assert ids[0] == 1
    assert llm.tokenizer.decode(ids[1:]) == "user: Tell me a story\nassistant:"


def test_cli_generate_prints_the_story():
    story, _ = _readme_blocks()
    proc = subprocess.run(
        [sys.executable, "-m", "dolmus.cli", "generate", "Once upon a time"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(story)


def test_cli_reports_bad_model_path(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dolmus.cli", "generate", "--model", str(tmp_path / "nope"), "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr


def test_chat_with_explicit_template(llm):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    convs = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be kind"}, {"role": "user", "content": "Hello"}],
    ]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=3), chat_template=template)
    assert llm.tokenizer.decode(outs[1].prompt_token_ids) == "[system] Be kind [user] Hello "
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 3 for o in outs)


def test_chat_rejects_malformed_messages(llm):
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}])

"""The reasoning parser (server/openai/reasoning.py): whole text and every streaming split."""

from __future__ import annotations

import pytest

from dolmus.server.openai.reasoning import ReasoningStream, reasoning_enabled, split_reasoning

CASES = [
    # (parser, text, reasoning, content)
    ("deepseek_r1", "<think>abc</think>answer", "abc", "answer"),
    ("deepseek_r1", "abc</think>answer", "abc", "answer"),  # the template opened <think>
    ("deepseek_r1", "still thinking <thi", "still thinking <thi", None),  # cut before </think>
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", "<thin", "<thin", None),
    ("deepseek_r1", "", None, None),
    ("qwen3", "<think>\nplan\n</think>\n\nThe answer.", "\nplan\n", "\n\nThe answer."),
    ("qwen3", "no thinking here </thi", None, "no thinking here </thi"),
    ("qwen3", "pre <think>r</think> post", "r", "pre  post"),
    ("qwen3", "<think>never closed", "never closed", None),
    ("qwen3", "a < b <th", None, "a < b <th"),
]


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_whole_text(parser: str, text: str, reasoning: str | None, content: str | None) -> None:
    assert split_reasoning(parser, text) == (reasoning, content)


def _streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    r, c = "", ""
    for i, piece in enumerate(pieces):
        dr, dc = stream.feed(piece, final=i == len(pieces) - 1)
        r, c = r + dr, c + dc
    assert stream.reasoning == r
    return r, c


@pytest.mark.parametrize("parser,text,reasoning,content", CASES)
def test_every_split_gives_the_same_parts(parser: str, text: str, reasoning: str | None, content: str | None):
    expected = (reasoning or "", content or "")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(parser, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(parser, list(text) + [""]) == expected  # one character a delta, then the end


def test_tags_never_leak_into_a_delta_early() -> None:
    stream = ReasoningStream("deepseek_r1")
    assert stream.feed("<thi") == ("", "")  # may be <think>: held
    assert stream.feed("nk>idea</th") == ("idea", "")  # a partial </think> is held too
    assert stream.feed("ink>ok") == ("", "ok")
    qwen = ReasoningStream("qwen3")
    assert qwen.feed("Hi <") == ("", "Hi ")
    assert qwen.feed("b>") == ("", "<b>")


def test_enable_thinking_false_switches_qwen3_off() -> None:
    assert reasoning_enabled("qwen3", None) and reasoning_enabled("qwen3", {"enable_thinking": True})
    assert not reasoning_enabled("qwen3", {"enable_thinking": False})
    assert reasoning_enabled("deepseek_r1", {"enable_thinking": False})  # its template always thinks
    assert not reasoning_enabled(None, None)
    with pytest.raises(ValueError, match="reasoning_parser"):
        reasoning_enabled("granite", None)

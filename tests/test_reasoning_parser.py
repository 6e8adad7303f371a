"""The reasoning parser (server/openai/reasoning.py): whole text and every streaming split."""

from __future__ import annotations

import pytest

from dolmus.server.openai.reasoning import ReasoningStream, reasoning_enabled, split_reasoning

CASES = [
    # (parser, under an output constraint, text, reasoning, content)
    ("deepseek_r1", False, "<think>abc</think>answer", "abc", "answer"),
    ("deepseek_r1", False, "abc</think>answer", "abc", "answer"),  # the template opened <think>
    ("deepseek_r1", False, "still thinking <thi", "still thinking <thi", None),  # cut before </think>
    ("deepseek_r1", False, "a</think>b</think>c", "a", "b</think>c"),
    ("deepseek_r1", False, "<thin", "<thin", None),
    ("deepseek_r1", False, "", None, None),
    # constrained from the first token: only a closed block is reasoning
    ("deepseek_r1", True, "<think>abc</think>answer", "abc", "answer"),
    ("deepseek_r1", True, "abc</think>answer", "abc", "answer"),
    ("deepseek_r1", True, '{"a": "</thi"}', None, '{"a": "</thi"}'),
    ("deepseek_r1", True, "<think>{}", None, "<think>{}"),
    ("deepseek_r1", True, "<thin", None, "<thin"),
    ("qwen3", False, "<think>\nplan\n</think>\n\nThe answer.", "\nplan\n", "\n\nThe answer."),
    ("qwen3", False, "no thinking here </thi", None, "no thinking here </thi"),
    ("qwen3", False, "pre <think>r</think> post", "r", "pre  post"),
    ("qwen3", False, "<think>never closed", "never closed", None),
    ("qwen3", False, "a < b <th", None, "a < b <th"),
    ("qwen3", True, '{"a": 1}', None, '{"a": 1}'),
]


@pytest.mark.parametrize("parser,constrained,text,reasoning,content", CASES)
def test_whole_text(parser: str, constrained: bool, text: str, reasoning: str | None, content: str | None):
    assert split_reasoning(parser, text, constrained) == (reasoning, content)


def _streamed(parser: str, constrained: bool, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser, constrained)
    r, c = "", ""
    for i, piece in enumerate(pieces):
        dr, dc = stream.feed(piece, final=i == len(pieces) - 1)
        r, c = r + dr, c + dc
    assert stream.reasoning == r
    return r, c


@pytest.mark.parametrize("parser,constrained,text,reasoning,content", CASES)
def test_every_split_gives_the_same_parts(
    parser: str, constrained: bool, text: str, reasoning: str | None, content: str | None
) -> None:
    expected = (reasoning or "", content or "")
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _streamed(parser, constrained, [text[:i], text[i:j], text[j:]]) == expected, (i, j)
    assert _streamed(parser, constrained, [*text, ""]) == expected  # one character a delta, then the end


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

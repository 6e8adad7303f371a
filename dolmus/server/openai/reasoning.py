"""Reasoning models: the text between `<think>` and `</think>` goes to `reasoning_content`,
the rest to `content` (`--reasoning-parser`, vLLM's names).

- deepseek_r1: the chat template opens `<think>`, so the output starts inside the think block:
  everything before `</think>` is reasoning (an explicit leading `<think>` is dropped). Output
  that never closes the block (cut by max_tokens) is all reasoning, as vLLM does.
- qwen3: reasoning only where the output opens `<think>`; text before it is content. A request
  with `chat_template_kwargs: {"enable_thinking": false}` is not parsed at all.

Under an output constraint (response_format, guided_*) the grammar shapes the output from its
first token (vLLM starts it after `</think>`; here it covers the think block too), so a
constrained deepseek_r1 output that never closes a think block is content, not reasoning: a
JSON reply stays a JSON reply. Streamed, such an output is held until `</think>` or its end.

The parser works on text, not token ids: a tag may be one special token or several ordinary
ones, and may arrive split across stream deltas. One state machine serves both cases: the
whole text is one feed, so a stream's joined deltas always equal the non-streamed split.
What could be the start of a tag is held back until the next delta tells.
"""

from __future__ import annotations

from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def reasoning_enabled(parser: str | None, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether a request's output is to be split (qwen3 with thinking switched off is not)."""
    if parser is None:
        return False
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {parser!r}")
    if parser == "qwen3" and (chat_template_kwargs or {}).get("enable_thinking") is False:
        return False
    return True


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` may be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Splits one choice's text, fed in deltas, into (reasoning, content) deltas."""

    def __init__(self, parser: str, constrained: bool = False) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}; got {parser!r}"
            )
        self.parser = parser
        # deepseek_r1 starts inside the block (an explicit `<think>` may still come first)
        self.state = _START
        # deepseek_r1 under a constraint: an unclosed think block is content, so hold it all
        self.hold_unclosed = constrained and parser == "deepseek_r1"
        self.opened = ""  # the explicit `<think>` dropped at the start, given back if unclosed
        self.pending = ""  # text not yet given out: a possible partial tag
        self.reasoning = ""  # all reasoning so far (for the usage's reasoning_tokens)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) the text so far allows to give out; `final` flushes the rest."""
        self.pending += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            text = self.pending
            if self.state == _START:
                if self.parser == "deepseek_r1":
                    if THINK_OPEN.startswith(text) and not final:
                        return self._out(reasoning, content)  # may yet be `<think>`
                    self.opened = THINK_OPEN if text.startswith(THINK_OPEN) else ""
                    self.pending = text[len(self.opened) :]
                    self.state = _REASONING
                    continue
                at = text.find(THINK_OPEN)
                if at >= 0:
                    content.append(text[:at])
                    self.pending = text[at + len(THINK_OPEN) :]
                    self.state = _REASONING
                    continue
                keep = 0 if final else _partial_tag(text, THINK_OPEN)
                content.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            if self.state == _REASONING:
                at = text.find(THINK_CLOSE)
                if at >= 0:
                    reasoning.append(text[:at])
                    self.pending = text[at + len(THINK_CLOSE) :]
                    self.state = _CONTENT
                    continue
                if self.hold_unclosed:
                    if final:  # never closed: it was no think block
                        content.append(self.opened + text)
                        self.pending = ""
                    break
                keep = 0 if final else _partial_tag(text, THINK_CLOSE)
                reasoning.append(text[: len(text) - keep])
                self.pending = text[len(text) - keep :]
                break
            content.append(text)
            self.pending = ""
            break
        return self._out(reasoning, content)

    def _out(self, reasoning: list[str], content: list[str]) -> tuple[str, str]:
        r = "".join(reasoning)
        self.reasoning += r
        return r, "".join(content)


def split_reasoning(parser: str, text: str, constrained: bool = False) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a finished output; None for a part that is empty."""
    reasoning, content = ReasoningStream(parser, constrained).feed(text, final=True)
    return reasoning or None, content or None

"""Where benchmark requests come from: synthetic lengths, ShareGPT files, traces.

A trace is JSONL, one request per line:
    {"timestamp": 0.25, "prompt": "...", "output_len": 64, "tier": "batch", "app": "rag"}
`timestamp` is seconds from the start; `prompt_len` may replace `prompt` (a prompt of that
many tokens is made up); `tier` (interactive | batch), `priority` (int) and `app` (or
`source`) are optional.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class BenchRequest:
    prompt: str | list[int]
    output_len: int
    prompt_len: int | None = None  # as built; the server's usage reports the truth
    timestamp: float | None = None  # seconds from start (traces)
    tier: str | None = None
    priority: int | None = None
    app: str | None = None


@dataclass(frozen=True)
class LengthDist:
    """`N` (always N) or `A:B` (uniform integers in [A, B])."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        try:
            parts = [int(p) for p in str(text).split(":")]
        except ValueError:
            raise ValueError(f"length {text!r} must be N or A:B (integers)") from None
        if len(parts) == 1:
            parts *= 2
        if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
            raise ValueError(f"length {text!r} must be N or A:B with 1 <= A <= B")
        return cls(parts[0], parts[1])

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


class PromptMaker:
    """Makes prompts of a given token length from a tokenizer's plain word tokens.

    Random word-start tokens decode to text that re-tokenizes to about the same count, so
    the same prompts work against any OpenAI-compatible server (which tokenizes itself).
    """

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        vocab = tokenizer.get_vocab()
        words = [
            i for tok, i in vocab.items() if tok[:1] in ("▁", "Ġ") and tok[1:].isalpha() and len(tok) > 2
        ]
        if len(words) < 20:
            words = [i for tok, i in vocab.items() if tok.isalpha()]
        if not words:
            raise ValueError("the tokenizer has no plain word tokens to build prompts from")
        self.words = sorted(words)

    def ids(self, length: int) -> list[int]:
        return [self.rng.choice(self.words) for _ in range(length)]

    def text(self, length: int) -> str:
        return self.tokenizer.decode(self.ids(length)).strip()


def synthetic(
    maker: PromptMaker,
    num_requests: int,
    input_len: LengthDist,
    output_len: LengthDist,
    seed: int = 0,
    shared_prefix_len: int = 0,
    shared_prefix_ratio: float = 1.0,
) -> list[BenchRequest]:
    """Seeded random prompts; a `shared_prefix_ratio` share of them start with one common
    `shared_prefix_len`-token prefix (a system prompt), which the prefix cache can reuse."""
    if not 0 <= shared_prefix_ratio <= 1:
        raise ValueError(f"shared_prefix_ratio must be in [0, 1], got {shared_prefix_ratio}")
    rng = random.Random(seed)
    prefix = maker.text(shared_prefix_len) + " " if shared_prefix_len else ""
    out = []
    for _ in range(num_requests):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        shared = prefix if prefix and rng.random() < shared_prefix_ratio else ""
        out.append(
            BenchRequest(shared + maker.text(n_in), n_out, n_in + (shared_prefix_len if shared else 0))
        )
    return out


def load_sharegpt(
    path: str | Path, num_requests: int, seed: int = 0, max_output_len: int = 1024
) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's length in words as the output length."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if (
            len(turns) >= 2
            and isinstance(turns[0].get("value"), str)
            and isinstance(turns[1].get("value"), str)
        ):
            prompt, reply = turns[0]["value"], turns[1]["value"]
            if prompt.strip() and reply.strip():
                pairs.append((prompt, min(max(1, round(len(reply.split()) * 1.3)), max_output_len)))
    if not pairs:
        raise ValueError(f"{path}: no conversation with a prompt and a reply")
    rng = random.Random(seed)
    rng.shuffle(pairs)
    return [BenchRequest(p, n) for p, n in (pairs * (num_requests // len(pairs) + 1))[:num_requests]]


def load_trace(path: str | Path, maker: PromptMaker | None = None) -> list[BenchRequest]:
    requests = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            output_len = int(row["output_len"])
            timestamp = float(row["timestamp"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{lineno}: needs JSON with timestamp and output_len ({exc})") from None
        prompt = row.get("prompt")
        prompt_len = row.get("prompt_len")
        if prompt is None:
            if prompt_len is None or maker is None:
                raise ValueError(f"{path}:{lineno}: needs a prompt, or a prompt_len and a tokenizer")
            prompt = maker.text(int(prompt_len))
        tier = row.get("tier")
        if tier is not None and tier not in ("interactive", "batch"):
            raise ValueError(f"{path}:{lineno}: tier must be interactive or batch, got {tier!r}")
        requests.append(
            BenchRequest(
                prompt,
                output_len,
                prompt_len,
                timestamp,
                tier,
                row.get("priority"),
                row.get("app") or row.get("source"),
            )
        )
    if not requests:
        raise ValueError(f"{path}: the trace is empty")
    requests.sort(key=lambda r: r.timestamp or 0.0)
    return requests

"""What Ollama's generate and chat share: model names, options and `format` as the engine's
sampling parameters, the final line's counters, and NDJSON streaming."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import StreamingResponse

from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.errors import APIError
from dolmus.server.model_names import ModelNames
from dolmus.server.ollama.protocol import Options
from dolmus.server.openai.shared import top
from dolmus.server.serving_common import Serving, sampling_default
from dolmus.structured.spec import StructuredOutput

_LATEST = "latest"


def ollama_name(served: str) -> str:
    """The served name as Ollama lists models, `name:tag`: the served name itself when it ends
    in a tag already (a colon, then a tag without a slash: "qwen3:0.6b"), else `<name>:latest`."""
    base, colon, tag = served.rpartition(":")
    if colon and base and tag and "/" not in tag:
        return served
    return f"{served}:{_LATEST}"


def check_model(serving: Serving, name: str) -> None:
    """400 without a model, 404 for one not served here. Ollama clients send `name:tag`: the
    listed name and `<served>:latest` are accepted beside the served name and its aliases."""
    if not name:
        raise APIError(400, "model is required", param="model")
    names: ModelNames = serving.names
    if name in (ollama_name(names.served), f"{names.served}:{_LATEST}"):
        return
    serving.check_model(name)


def sampling_params(
    options: Options | None, structured: StructuredOutput | None = None, logprobs: int | None = None
) -> SamplingParams:
    """The engine's parameters for Ollama's options (the server's defaults for those left out);
    `logprobs`: the alternatives to return per token (None: no logprobs)."""
    o = options or Options()
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    try:
        return SamplingParams(
            temperature=sampling_default(o.temperature, "temperature"),
            top_p=sampling_default(o.top_p, "top_p"),
            top_k=sampling_default(o.top_k, "top_k"),
            min_p=sampling_default(o.min_p, "min_p"),
            repetition_penalty=sampling_default(o.repeat_penalty, "repetition_penalty"),
            presence_penalty=sampling_default(o.presence_penalty, "presence_penalty"),
            frequency_penalty=sampling_default(o.frequency_penalty, "frequency_penalty"),
            seed=o.seed,
            max_tokens=max_tokens,
            stop=o.stop or [],
            structured_output=structured,
            logprobs=logprobs,
        )
    except ValueError as exc:
        raise APIError(400, f"options: {exc}", param="options") from exc


async def format_constraint(serving: Serving, fmt: str | dict[str, Any] | None) -> StructuredOutput | None:
    """`format`: "json" is any JSON object, a dict is a JSON schema; compiled now (400 if bad)."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        spec = StructuredOutput.json_object()
    elif isinstance(fmt, dict):
        try:
            spec = StructuredOutput.json_schema(fmt)
        except ValueError as exc:
            raise APIError(400, f"format: {exc}", param="format") from exc
    else:
        raise APIError(400, f'format must be "json" or a JSON schema object, got {fmt!r}', param="format")
    return await serving.compile_constraint(spec, "format")


def refuse_unsupported(think: bool | str | None, images: bool) -> None:
    """400 for what Ollama offers and dolmus does not (rather than silently answering without it)."""
    if think:
        raise APIError(400, "this model does not support thinking (think)", param="think")
    if images:
        raise APIError(400, "this model does not support images", param="images")


def token_logprobs(serving: Serving, c: CompletionOutput, start: int, k: int) -> list[dict[str, Any]]:
    """Ollama's `logprobs` of the completion's tokens from `start` on: each token's text,
    logprob and bytes, with its `k` most likely alternatives."""
    if c.logprobs is None:
        return []

    def entry(tid: int, value: float | None) -> dict[str, Any]:
        text = serving.token_text(tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    out = []
    for tid, lp in zip(c.token_ids[start:], c.logprobs[start:]):
        item = entry(tid, lp.get(tid))
        item["top_logprobs"] = [entry(t, v) for t, v in top(lp, k)]
        out.append(item)
    return out


def created_at() -> str:
    """Now, as Ollama writes it (RFC 3339, UTC, a Z suffix)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def final_fields(serving: Serving, out: RequestOutput, started_ns: int) -> dict[str, Any]:
    """The last object's counters, in Ollama's names and units (durations in nanoseconds).

    prompt_eval_count is the whole prompt (a prefix-cache hit is not re-evaluated but still
    counts, so clients that add up tokens see the conversation's size); load_duration is 0, the
    model being loaded once at start; eval_duration runs from the first output token to the last.
    """
    c = out.outputs[0]
    t = serving.timings([out])
    return {
        "done": True,
        "done_reason": "length" if c.finish_reason == "length" else "stop",
        "total_duration": time.monotonic_ns() - started_ns,
        "load_duration": 0,
        "prompt_eval_count": len(out.prompt_token_ids),
        "prompt_eval_duration": int(t["prompt_ms"] * 1e6),
        "eval_count": len(c.token_ids),
        "eval_duration": int(t["predicted_ms"] * 1e6),
    }


def ndjson(objects: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Ollama's stream: one JSON object a line; an error mid-stream (the status line has gone
    already) is an `{"error": ...}` line, which Ollama's clients raise."""

    async def body() -> AsyncIterator[str]:
        try:
            async for obj in objects:
                yield json.dumps(obj, ensure_ascii=False) + "\n"
        except APIError as exc:
            yield json.dumps({"error": exc.message}, ensure_ascii=False) + "\n"

    return StreamingResponse(body(), media_type="application/x-ndjson")

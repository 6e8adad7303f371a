"""What OpenAI's completions and chat completions have in common: sampling fields, output
constraints (response_format and vLLM's guided_* fields), usage, and a stream chunk's
envelope."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dolmus.outputs import RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.errors import APIError
from dolmus.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from dolmus.server.serving_common import Job, Serving, sampling_default
from dolmus.structured.spec import StructuredOutput

Body = CompletionRequest | ChatCompletionRequest


def sampling_params(
    body: Body, max_tokens: int | None, logprobs: int | None, structured: StructuredOutput | None = None
) -> SamplingParams:
    """The engine's parameters for a request's sampling fields (400 naming a bad one)."""
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(
            400,
            "best_of is not supported: dolmus returns n samples without ranking them; "
            "leave best_of unset or equal to n",
            param="best_of",
        )
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    try:
        return SamplingParams(
            n=body.n,
            temperature=sampling_default(body.temperature, "temperature"),
            top_p=sampling_default(body.top_p, "top_p"),
            top_k=sampling_default(body.top_k, "top_k"),
            min_p=sampling_default(body.min_p, "min_p"),
            repetition_penalty=sampling_default(body.repetition_penalty, "repetition_penalty"),
            presence_penalty=sampling_default(body.presence_penalty, "presence_penalty"),
            frequency_penalty=sampling_default(body.frequency_penalty, "frequency_penalty"),
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_output=structured,
            kv_transfer_params=body.kv_transfer_params,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from exc


async def output_constraint(
    serving: Serving, body: Body, from_tools: StructuredOutput | None = None
) -> StructuredOutput | None:
    """The request's one output constraint, if any, compiled (a bad one is a 400 naming its field)."""
    rf = body.response_format
    makers: list[tuple[str, Any, Callable[[Any], StructuredOutput]]] = [
        ("response_format", rf if rf and rf.type != "text" else None, _from_response_format),
        ("guided_json", body.guided_json, StructuredOutput.json_schema),
        ("guided_regex", body.guided_regex, StructuredOutput.regex),
        ("guided_grammar", body.guided_grammar, StructuredOutput.grammar),
        ("guided_choice", body.guided_choice, StructuredOutput.choice),
    ]
    given: list[tuple[str, StructuredOutput]] = []
    for param, value, make in makers:
        if value is None:
            continue
        try:
            given.append((param, make(value)))
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc
    if from_tools is not None:
        given.append(("tool_choice", from_tools))
    if len(given) > 1:
        raise APIError(
            400, f"give one output constraint, not {', '.join(n for n, _ in given)}", param=given[1][0]
        )
    if not given:
        return None
    param, spec = given[0]
    return await serving.compile_constraint(spec, param)


def _from_response_format(rf: ResponseFormat) -> StructuredOutput:
    if rf.type == "json_object":
        return StructuredOutput.json_object()
    schema = (rf.json_schema or {}).get("schema")
    if schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return StructuredOutput.json_schema(schema)


def include_usage(body: Body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def envelope(serving: Serving, job: Job, obj: str, choices: list[Any], **fields: Any) -> dict[str, Any]:
    """A response body or one streamed event; `fields` adds top-level keys such as `usage`."""
    return {
        "id": job.request_id,
        "object": obj,
        "created": job.created,
        "model": serving.model_name,
        "choices": choices,
        **fields,
    }


def kv_transfer_field(outputs: list[RequestOutput]) -> dict[str, Any]:
    """A prefill worker's `kv_transfer_params` for the decode worker, top level as vLLM puts it
    (absent, not null, when there are none)."""
    params = next((out.kv_transfer_params for out in outputs if out.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}


def usage(job: Job, outputs: list[RequestOutput], reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The usage field; `reasoning_tokens` (under a reasoning parser) goes into
    completion_tokens_details as OpenAI reports it for its reasoning models."""
    prompt = sum(len(ids) for ids in job.prompts)
    completion = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outputs)},
    }
    metrics = [c.metrics for out in outputs for c in out.outputs if c.metrics is not None]
    drafted = sum(m.num_draft_tokens for m in metrics)
    details: dict[str, int] = {}
    if drafted:  # speculative decoding, in the fields OpenAI uses for predicted outputs
        accepted = sum(m.num_accepted_tokens for m in metrics)
        details = {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    if details:
        result["completion_tokens_details"] = details
    return result


def top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The `k` most likely tokens of a position's logprobs, most likely first."""
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]

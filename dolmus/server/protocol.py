"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names and defaults follow OpenAI's API, plus the vLLM extensions that self-hosters
use (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, priority,
...). Unknown fields are ignored, as OpenAI's own SDKs may send newer ones.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        """JSON may carry a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text: the
        tokenizer cannot take it and no response holding it can be encoded, so refuse it here."""
        found = _lone_surrogate(value)
        if found is None:
            return value
        path, char = found
        where = f" at {info.field_name}{path}" if path else ""
        raise PydanticCustomError(
            "lone_surrogate",
            "contains a lone surrogate ({char}){where}, which is not valid Unicode text; send UTF-8 "
            "(a character outside the BMP escapes as a surrogate pair)",
            {"char": f"\\u{ord(char):04x}", "where": where},
        )


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}


class _SamplingFields(_Body):
    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None  # lower runs first; overrides the X-Priority header
    # Structured output: OpenAI's response_format, or vLLM's guided_* extras (one at most).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # Disaggregated prefill/decode (vLLM's protocol, as vllm-router and llm-d send it)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(path inside `value`, the character) of the first lone surrogate, or None."""
    try:  # the common case, at C speed: nothing to find
        json.dumps(value, ensure_ascii=False, default=lambda _: None).encode()
        return None
    except UnicodeEncodeError:
        pass
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError as exc:
                return path, item[exc.start]
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = f"{path}.{_printable(key)}"
                stack += [(name, child), (name, key)]
        elif isinstance(item, list | tuple):
            stack += [(f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item)))]
    return None


def _printable(key: Any) -> str:
    """A dict key as it may appear in an error message (which must itself encode as UTF-8)."""
    return str(key).encode("utf-8", "backslashreplace").decode()

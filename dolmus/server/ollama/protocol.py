"""Request bodies of Ollama's API, as pydantic models.

Fields follow Ollama's docs/api.md and its Python client (ollama 0.5-0.6). Unknown fields are
ignored, as Ollama ignores them. `options` stays a free dict: Ollama takes any of its
Modelfile parameters there, and shared.py maps the sampling ones and ignores the runtime ones.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from dolmus.server.protocol import MAX_TOP_LOGPROBS, _Body


class Options(_Body):
    """The sampling parameters among Ollama's options; its runtime ones (num_thread, num_gpu,
    mirostat, ...) are dropped, as Ollama drops options a runner does not know."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    num_predict: int | None = None  # -1: no limit, -2: fill the context (both: up to the context)
    stop: str | list[str] | None = None
    seed: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Validated, then ignored: the engine's context length is fixed when the model loads, and a
    # request never runs past it (check_length is a 400 there instead of Ollama's truncation).
    num_ctx: int | None = Field(default=None, gt=0)


class _ModelFields(_Body):
    model: str = ""  # the client checks it is non-empty; shared.check_model answers 400 if not
    options: Options | None = None
    format: str | dict[str, Any] | None = None  # "json", a JSON schema, or ""/None
    keep_alive: float | str | None = None  # accepted, ignored: the model stays loaded
    stream: bool = True
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)


class GenerateRequest(_ModelFields):
    prompt: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    context: list[int] | None = None
    suffix: str | None = None
    images: list[Any] | None = None


class Message(_Body):
    role: str
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None  # Open WebUI sends OpenAI's field on tool results
    thinking: str | None = None


class ChatRequest(_ModelFields):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class ShowRequest(_Body):
    model: str = ""
    name: str | None = None  # the older clients' field for the model
    verbose: bool = False

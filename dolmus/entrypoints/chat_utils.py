"""Render chat messages into a prompt with the model's template (or a plain fallback).

transformers renders chat templates in a sandboxed jinja2 environment, so a template
shipped with a model cannot reach outside it.
"""

from __future__ import annotations

import inspect
from typing import Any

# For models without a chat template (base models such as stories260k): one line per
# message, "role: content", then "assistant:" to prompt the reply. Documented in README.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# template variables set here (apply_chat_template's own arguments are refused as well: a
# request must not turn on tokenize, return_dict and the like)
_RESERVED = {"messages", "conversation", "chat_template", "add_generation_prompt", "tokenize", "tools"}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of the rendered conversation (special tokens come from the template).

    `template_kwargs` are extra variables for the template (a request's chat_template_kwargs,
    such as Qwen3's enable_thinking); they may not replace the ones set here."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError("each message needs a 'role' and a 'content'")
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    taken = sorted(set(template_kwargs or {}) & (_RESERVED | own))
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
    template = chat_template or getattr(tokenizer, "chat_template", None) or FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=tools,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # jinja errors, sandbox violations
        raise ValueError(f"chat template failed to render: {exc}") from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = getattr(tokenizer, "bos_token_id", None)
    if template is FALLBACK_CHAT_TEMPLATE and bos is not None:
        ids = [bos, *ids]  # base models expect their BOS; the fallback text has none
    return ids

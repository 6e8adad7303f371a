"""Loading a model's tokenizer, and a prompt checked and turned into token ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from dolmus.runtime.gguf_loader import gguf_tokenizer, is_gguf


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model folder (transformers') or a GGUF file (its own vocabulary)."""
    if is_gguf(path):
        return gguf_tokenizer(Path(path))
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises several types for a bad folder
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} ({exc})") from exc


def tokenize_prompt(
    tokenizer: Any, prompt: str | Sequence[int], vocab_size: int
) -> tuple[str | None, list[int]]:
    """(the text, or None for ids given as such; the token ids), or ValueError naming the fault."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        return prompt, list(tokenizer.encode(prompt))
    ids = list(prompt)
    if not ids:
        raise ValueError("prompt must not be empty")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return None, ids

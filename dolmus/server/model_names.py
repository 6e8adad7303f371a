"""The name a server lists its model under, and the other names a request may use for it.

`dolmus serve --model /models/SmolLM2/SmolLM2-135M-Instruct.Q4_1.gguf` used to serve the
model as that path: clients (and the chat page's model picker) showed the server's folders.
The served name now defaults to a short one: the folder's name for a Hugging Face folder,
a GGUF file's stem (what its user named it, quantization suffix included, as Ollama's and
llama.cpp's users know their files; `general.name` is free text, often with spaces), and
"stories260k" for the built-in model. `--served-model-name` still wins. The path as given
(and as resolved) stays accepted in a request's `model` field, so clients written against
the old name keep working.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dolmus.config import DEFAULT_MODEL_DIR

BUILT_IN_NAME = "stories260k"  # the built-in model (dolmus/default_model), however it is named


@dataclass(frozen=True)
class ModelNames:
    """`served`: what /v1/models lists and responses carry; `aliases`: also accepted in requests."""

    served: str
    aliases: tuple[str, ...] = ()

    def accepts(self, name: str) -> bool:
        return name == self.served or name in self.aliases

    @classmethod
    def for_model(cls, model: str | None, served_model_name: str | None = None) -> ModelNames:
        """The names of the model `--model` points at (None: the built-in one)."""
        if model is None:
            return cls(served_model_name or BUILT_IN_NAME)
        served = served_model_name or short_name(model)
        aliases = {model, str(Path(model).resolve())} if Path(model).exists() else {model}
        return cls(served, tuple(sorted(aliases - {served})))


def short_name(model: str) -> str:
    """A model's default served name: the GGUF's file stem, the folder's name;
    anything else (not a path here) as given."""
    path = Path(model)
    if path.resolve() == DEFAULT_MODEL_DIR.resolve():
        return BUILT_IN_NAME
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    if path.is_dir():
        return path.resolve().name or model
    return model

"""dolmus: an LLM inference engine and server on PyTorch.

The public names load on first use (PEP 562), so a process that needs only part of the
package (the server's engine core, spawned at start; `dolmus bench` against another
server) does not pay for importing the rest.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dolmus.config import EngineConfig
    from dolmus.entrypoints.llm import LLM
    from dolmus.outputs import CompletionOutput, RequestOutput
    from dolmus.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "dolmus.entrypoints.llm",
    "SamplingParams": "dolmus.sampling_params",
    "EngineConfig": "dolmus.config",
    "RequestOutput": "dolmus.outputs",
    "CompletionOutput": "dolmus.outputs",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'dolmus' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # the next lookup finds it without coming here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

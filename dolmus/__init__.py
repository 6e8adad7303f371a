"""dolmus: an LLM inference engine and server on PyTorch."""

from dolmus.config import EngineConfig
from dolmus.entrypoints.llm import LLM
from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

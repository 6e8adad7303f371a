"""Per-request generation settings, validated where they are made.

Names and meanings follow OpenAI's and vLLM's, so the server maps fields one-to-one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dolmus.pooling_params import PoolingParams
from dolmus.structured.spec import StructuredOutput

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output, as in transformers/vLLM
    presence_penalty: float = 0.0  # over output tokens, as in OpenAI
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives besides the chosen token
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # JSON schema, regex, grammar or choice
    # Disaggregated prefill/decode, vLLM's protocol: {"do_remote_decode": true} asks a prefill
    # worker to keep the prompt's KV for a decode worker; the prefill response's params (with
    # "do_remote_prefill": true and the worker's address) make a decode worker fetch it.
    kv_transfer_params: dict[str, Any] | None = None
    # An embedding request (pooling_params.py): pools the prompt's final hidden states into a
    # vector and finishes when its prompt is done, sampling nothing (max_tokens is unused).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (or -1 for none)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must hold non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.structured_output is not None and self.min_tokens:
            # The grammar may allow nothing but EOS while min_tokens forbids it.
            raise bad("min_tokens", "cannot be combined with structured output")
        self._validate_kv_transfer_params()
        if self.pooling is not None and (self.n != 1 or self.structured_output is not None):
            raise ValueError("an embedding request (pooling) takes n=1 and no structured output")

    def _validate_kv_transfer_params(self) -> None:
        params = self.kv_transfer_params
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {params!r}")
        if params.get("do_remote_prefill"):
            host, port = params.get("remote_host"), params.get("remote_port")
            if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(
                    "kv_transfer_params: do_remote_prefill needs remote_host (a string) and remote_port "
                    f"(a TCP port), got {host!r} and {port!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def overlappable(params: SamplingParams, seed: int | None) -> bool:
    """Whether a request's sampling can run while its previous token is still on the device:
    nothing it samples with reads its earlier tokens or their count on the host."""
    return (
        seed is None
        and not params.has_penalties
        and not params.min_tokens
        and params.logprobs is None
        and params.structured_output is None
        and params.pooling is None
    )

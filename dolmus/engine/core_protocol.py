"""Messages between the API server and the engine core process (msgspec over ZeroMQ).

Typed msgspec structs: the core decodes straight into SamplingParams and the front end into
EngineStats (a dataclass); outputs travel as deltas (output_delta.py), so a step's
message stays the size of the step's news however long the outputs grow.
"""

from __future__ import annotations

import msgspec

from dolmus.engine.output_delta import OutputDelta
from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic() in the front end (one clock for every process here)


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class ListRequests(msgspec.Struct, tag=True):
    """Asks for the sequences in the engine; answered by a RequestList with the same token."""

    token: int


class ResetPrefixCache(msgspec.Struct, tag=True):
    """Asks the core to forget its cached prefixes; answered by a PrefixCacheReset."""

    token: int


ToCore = AddRequest | AbortRequest | Shutdown | ListRequests | ResetPrefixCache


class Ready(msgspec.Struct, tag=True):
    max_model_len: int
    stats: EngineStats


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class RequestError(msgspec.Struct):
    """A request the engine refused or dropped: a bad request (400) unless `code` says it was
    a tier rule (429 with Retry-After)."""

    request_id: str
    message: str
    code: str | None = None
    retry_after: float | None = None
    status: int = 429  # with a code: the HTTP status it maps to


class StepOutputs(msgspec.Struct, tag=True):
    """What one pass of the core loop produced: outputs, refused requests, a fresh snapshot."""

    outputs: list[OutputDelta]  # only what is new since each request's previous message
    errors: list[RequestError]
    num_applied_adds: int  # sequences added to the engine since the last message
    stats: EngineStats


class CoreDied(msgspec.Struct, tag=True):
    message: str


class RequestList(msgspec.Struct, tag=True):
    token: int
    requests: list[RequestSummary]


class PrefixCacheReset(msgspec.Struct, tag=True):
    token: int
    done: bool  # False: requests were in the engine, nothing was forgotten


FromCore = Ready | LoadFailed | StepOutputs | CoreDied | RequestList | PrefixCacheReset

to_core_encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_encoder = msgspec.msgpack.Encoder()
from_core_decoder = msgspec.msgpack.Decoder(FromCore)

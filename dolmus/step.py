"""The engine <-> runner contract: what one step computes, and what it produced.

Plain data (no torch, no engine objects), so the same plan runs the model in this process,
in worker processes, or on other hosts. The plan is a diff, as in vLLM v1: a request's
prompt, sampling settings and blocks are sent once, when it is first scheduled (or again
after a preemption, which made the runner forget it); after that only what changed travels:
the blocks it gained and how many tokens to compute, in columns (a list per field, not an
object per request), which is what makes a 256-request decode step cheap to send. The runner
keeps the rest (token ids, block-table rows) and appends the tokens it returns to its copy.

A result carries a list of tokens per request: one for a plain step, several when drafted
tokens were accepted. The engine checks stop conditions after each of them in order.

msgspec structs: `encode` / `decode_plan` / `decode_result` turn them into msgpack bytes
(what worker processes receive) at a few nanoseconds per token id.
"""

from __future__ import annotations

import msgspec

from dolmus.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, array_like=True):
    """A request the runner does not know yet (new, or resumed after a preemption)."""

    request_id: str
    token_ids: list[int]  # prompt, then any output made before a preemption
    num_prompt_tokens: int
    params: SamplingParams
    seed: int | None  # per-sequence seed (an n > 1 request's children each have their own)
    stop_token_ids: list[int]  # forbidden until params.min_tokens outputs exist
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in its blocks (prefix-cache hits)


class RunningRequests(msgspec.Struct, array_like=True):
    """Requests the runner already holds: only what changed since the last step, by column."""

    request_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []  # as the scheduler counts them (authoritative)

    def append(self, request_id: str, new_block_ids: list[int], num_computed_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.new_block_ids.append(new_block_ids)
        self.num_computed_tokens.append(num_computed_tokens)

    def __len__(self) -> int:
        return len(self.request_ids)


class BlockLoad(msgspec.Struct, array_like=True):
    """Blocks of one request to fill from outside the paged cache, in chain order.

    `source` "" is this engine's offload tier; otherwise the transfer address of the remote
    engine (a prefill worker) whose rank r serves rank r's share."""

    request_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    source: str = ""


class KVTransfer(msgspec.Struct, array_like=True):
    """What the KV connector moves around this step's forward pass (kv_connector/).

    Saves are taken from the blocks before the forward pass writes anything (a block saved
    because it is being evicted may be overwritten by this very step); loads fill blocks no
    scheduled request reads in this step. Every rank does the same with its own share."""

    loads: list[BlockLoad] = []
    save_hashes: list[bytes] = []  # into the offload tier
    save_block_ids: list[int] = []
    # into the outbox a decode worker fetches from; taken after the forward pass, which writes them
    export_hashes: list[bytes] = []
    export_block_ids: list[int] = []
    drop_hashes: list[bytes] = []  # out of the offload tier (evicted from it, or found bad)
    drop_export_hashes: list[bytes] = []  # out of the outbox (pushed out by newer exports)

    @property
    def empty(self) -> bool:
        moves = (self.loads, self.save_hashes, self.export_hashes, self.drop_hashes, self.drop_export_hashes)
        return not any(moves)


class StepPlan(msgspec.Struct):
    new_requests: list[NewRequest] = []
    running: RunningRequests = msgspec.field(default_factory=RunningRequests)
    num_scheduled_tokens: dict[str, int] = {}  # every scheduled request
    draft_token_ids: dict[str, list[int]] = {}  # speculative tokens to check
    finished_ids: list[str] = []  # the runner drops their state
    preempted_ids: list[str] = []  # likewise; they come back as new requests
    # Structured output: int32 words (bit set = token allowed), one row per sampled position of
    # each constrained request (1 + its drafts; a request's rows are consecutive), rows in
    # `grammar_request_ids` order, as raw bytes (native byte order).
    grammar_bitmask: bytes | None = None
    grammar_request_ids: list[str] = []
    kv_transfer: KVTransfer | None = None  # blocks to load, save and drop (a KV connector is on)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def empty(self) -> bool:
        return not self.num_scheduled_tokens


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The chosen token's log-probability and the top alternatives (the chosen one included)."""

    logprob: float
    top: dict[int, float]


class StepResult(msgspec.Struct):
    sampled: dict[str, list[int]] = {}  # requests whose chunk reached its end
    logprobs: dict[str, list[TokenLogprobs]] = {}  # where asked, one per token
    # Embedding requests whose prompt is done: the pooled vector (float32 values), no token.
    embeddings: dict[str, list[float]] = {}
    # Per request of the plan's loads: how many of its blocks, from the first, every rank
    # loaded and verified (the rest stay to be computed).
    kv_loaded: dict[str, int] = {}
    # A Mixture-of-Experts model's tokens routed to each expert since load, per decoder layer
    # (an empty row for a dense one); only now and then (runtime/expert_load.py), else None.
    moe_expert_tokens: list[list[int]] | None = None


_encoder = msgspec.msgpack.Encoder()
_plan_decoder = msgspec.msgpack.Decoder(StepPlan)
_result_decoder = msgspec.msgpack.Decoder(StepResult)


def encode(message: StepPlan | StepResult) -> bytes:
    return _encoder.encode(message)


def decode_plan(data: bytes) -> StepPlan:
    return _plan_decoder.decode(data)


def decode_result(data: bytes) -> StepResult:
    return _result_decoder.decode(data)

"""What every API endpoint shares, whatever its wire format: one engine, its limits, and the
life of a job in it.

An API module (server/openai/completions.py, server/openai/chat.py, ...) is a thin
translation: it reads its request shape into token ids and `SamplingParams`, asks `Serving`
to check and admit a `Job`, then turns the engine's `RequestOutput`s back into its own
response shape. Everything else lives here once: the model-name check, prompt and context
checks, admission (waiting-queue room, KV demand, the key's quotas), compiling an output
constraint before the engine sees it, submitting one engine request per prompt, merging
their streams, noticing a client that went away (its requests are aborted, which frees their
KV blocks before the next step), engine errors as API errors, and server-sent events.
This module imports no API module.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import weakref
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from dolmus.config.server import ServerConfig
from dolmus.engine.admission import RequestRefused
from dolmus.engine.async_engine import AsyncEngine, EngineDeadError
from dolmus.engine.core_client import EngineCoreClient
from dolmus.engine.data_parallel import DataParallelClient
from dolmus.engine.request_group import CHILD_SEP
from dolmus.outputs import CompletionOutput, RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.server.access import Client, QuotaExceeded, charge
from dolmus.server.errors import APIError, error_body
from dolmus.server.model_names import ModelNames
from dolmus.server.timings import timings
from dolmus.structured.spec import StructuredOutput

_DISCONNECT_POLL_S = 0.2
# What a request gets for a field it leaves out (the page shows these as its defaults).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "max_tokens": None,  # up to the context length
}


def sampling_default(value: Any, name: str) -> Any:
    """`value`, or the server's default for the sampling field `name` when it is None."""
    return SAMPLING_DEFAULTS[name] if value is None else value


@dataclass
class Job:
    """One HTTP request as the engine sees it: a prompt per engine request, shared params."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    priority: int
    created: int = field(default_factory=lambda: int(time.time()))
    client: Client | None = None
    charged: int = 0  # tokens taken from the client's quota; the unused part goes back at the end
    unsent: list[int] | None = None  # sequences admitted but not yet counted by the engine (_Unsent)

    def settle(self, outputs: Iterable[RequestOutput]) -> None:
        """Give the client's quota back what the job did not use (once, however it ended)."""
        if self.client is None or self.client.tokens is None or not self.charged:
            return
        used = sum(len(ids) for ids in self.prompts)
        used += sum(len(c.token_ids) for out in outputs for c in out.outputs)
        self.client.tokens.give_back(max(self.charged - used, 0))
        self.charged = 0


class _Unsent:
    """Sequences `_check_room` admitted that the engine does not count as waiting yet.

    The engine counts a request once the body of its `generate` runs, and the handlers get
    there only after more awaits (tasks created in `collect`; Starlette's first read of an SSE
    body): many handlers resuming together could all pass the check before any was counted
    (24 of 24 admitted under --max-waiting 2). Each admitted job holds its count here until its
    requests reach the engine, and gives back what never did when it ends or is collected."""

    def __init__(self) -> None:
        self.total = 0

    def admit(self, job: Job, n: int) -> None:
        cell = job.unsent = [n]
        self.total += n
        weakref.finalize(job, self._release, cell, n)  # a job dropped unseen (an SSE body never read)

    def _release(self, cell: list[int], n: int) -> None:
        taken = min(n, cell[0])
        cell[0] -= taken
        self.total -= taken

    def sent(self, job: Job, n: int) -> None:
        if job.unsent is not None:
            self._release(job.unsent, n)

    def done(self, job: Job) -> None:
        if job.unsent is not None:
            self._release(job.unsent, job.unsent[0])


class Serving:
    """The engine behind every endpoint, with the checks and bookkeeping they share."""

    def __init__(
        self,
        engine: AsyncEngine | EngineCoreClient | DataParallelClient,
        names: ModelNames,
        chat_template: str | None = None,
        max_waiting: int | None = None,
        max_n: int = ServerConfig.max_n,
        gpu_hour_cost: float | None = None,
    ) -> None:
        self.engine = engine
        self.gpu_hour_cost = gpu_hour_cost
        self.names = names
        self.model_name = self.names.served
        self.chat_template = chat_template
        self.max_waiting = max_waiting
        self._unsent = _Unsent()
        self.max_n = max_n
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.model_config.vocab_size
        # Engine request id -> (priority, app), while the request's job runs: the server's
        # per-tier metrics look up a finished output's tier here.
        self.in_flight: dict[str, tuple[int, str]] = {}
        self._token_text: dict[int, str] = {}
        self._anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1:]

    def app_of(self, engine_request_id: str) -> str | None:
        """The app (API key holder) of an engine request or of one of its n samples."""
        found = self.in_flight.get(engine_request_id) or self.in_flight.get(
            engine_request_id.rsplit(CHILD_SEP, 1)[0]
        )
        return found[1] if found is not None else None

    # -- checks ---------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (no name at all means ours)."""
        if name is not None and not self.names.accepts(name):
            raise APIError(
                404,
                f"model {name!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: Sequence[Any], param: str = "prompt") -> list[int]:
        if not ids:
            raise APIError(400, f"{param} must not be empty", param=param)
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"{param} token ids must be integers in [0, {self.vocab_size})", param=param)
        return list(ids)

    def check_length(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        room = self.max_model_len - len(ids)
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt "
                f"is {len(ids)} tokens, which leaves no room for output",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} for the output)",
                param=param,
                code="context_length_exceeded",
            )

    def check_n(self, n: int) -> None:
        """Each sample is a sequence in the engine: an unbounded n would queue millions of them."""
        if n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} (--max-n), got {n}", param="n")

    def _check_kv_demand(self, prompts: list[list[int]], n: int, max_tokens: int | None) -> None:
        """Refuse a request whose samples together need more KV than the whole cache holds.

        Such a request could never run all its samples at once: they would preempt each other
        (and everyone else) for as long as it lasts. Every prompt's choices count, and without
        max_tokens a sample may grow to the full context.
        """
        capacity = self.engine.stats.kv_capacity_tokens
        per_sample = [self.max_model_len if max_tokens is None else len(ids) + max_tokens for ids in prompts]
        demand = n * sum(per_sample)
        if demand > capacity:
            prompt_word = "prompt" if len(prompts) == 1 else f"prompt, for each of {len(prompts)} prompts"
            raise APIError(
                400,
                f"this request needs KV cache for {demand} tokens (n={n} x (tokens of the {prompt_word}"
                f" + max_tokens)), more than the {capacity} tokens the server's KV cache holds; "
                "lower n or max_tokens",
                param="n",
                code="context_length_exceeded",
            )

    def _check_room(self, num_new: int) -> None:
        """Admission control: refuse rather than queue without bound."""
        waiting = self.engine.num_waiting + self._unsent.total
        if self.max_waiting is not None and waiting + num_new > self.max_waiting:
            raise APIError(
                429,
                f"the server is busy: {waiting} requests are waiting "
                f"(--max-waiting {self.max_waiting}); retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            )

    def _charge(self, job: Job) -> None:
        """Take the job from its key's quotas (429 with Retry-After when over)."""
        if job.client is None:
            return
        n = job.params.n
        tokens = sum(
            len(ids) + n * (job.params.max_tokens or self.max_model_len - len(ids)) for ids in job.prompts
        )
        try:
            charge(job.client, tokens)
        except QuotaExceeded as exc:
            if exc.retry_after is None:
                raise APIError(400, str(exc), param="max_tokens", code="quota_too_small") from exc
            raise APIError(
                429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": exc.retry_after_header}
            ) from exc
        job.charged = tokens if job.client.tokens is not None else 0

    async def compile_constraint(self, spec: StructuredOutput, param: str) -> StructuredOutput:
        """Compile the output constraint now (in a worker thread, cached), so a bad one is a 400
        naming `param` here and the engine only ever sees specs that compile."""
        try:
            await asyncio.to_thread(self.engine.engine.grammars.compile, spec)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from exc
        return spec

    # -- admission ------------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        client: Client | None,
    ) -> Job:
        """A job for checked prompts, once the KV cache, the waiting queue and the key's quotas
        have room for all its sequences (API errors otherwise)."""
        num_new = len(prompts) * params.n
        self._check_kv_demand(prompts, params.n, params.max_tokens)
        self._check_room(num_new)
        job = Job(request_id, prompts, params, priority, client=client)
        self._charge(job)
        self._unsent.admit(job, num_new)
        return job

    # -- running jobs ---------------------------------------------------------------------

    def timings(
        self, outputs: Sequence[RequestOutput], completions: Sequence[CompletionOutput] | None = None
    ) -> dict[str, Any]:
        return timings(outputs, completions, self.engine.stats, self.gpu_hour_cost)

    def _generators(self, job: Job) -> list[AsyncIterator[RequestOutput]]:
        gens = []
        for p, ids in enumerate(job.prompts):
            rid = f"{job.request_id}-{p}"
            self.in_flight[rid] = (job.priority, job.client.name if job.client is not None else "default")
            gens.append(self._counted(job, self.engine.generate(rid, ids, job.params, job.priority)))
        return gens

    async def _counted(self, job: Job, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        # The engine counts the request in the first step of `gen`, which runs in this same
        # step (nothing awaits in between): the job's own count can go.
        self._unsent.sent(job, job.params.n)
        async with contextlib.aclosing(gen):  # type: ignore[type-var]
            async for out in gen:
                yield out

    def _done(self, job: Job) -> None:
        self._unsent.done(job)
        for p in range(len(job.prompts)):
            self.in_flight.pop(f"{job.request_id}-{p}", None)

    async def stream(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt of the job, tagged with the prompt's index, as they come."""
        last: dict[int, RequestOutput] = {}
        try:
            async for p, out in self._merged(job):
                last[p] = out
                yield p, out
        finally:
            job.settle(last.values())
            self._done(job)

    async def _merged(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        gens = self._generators(job)
        if len(gens) == 1:
            async for out in engine_errors(gens[0]):
                yield 0, out
            return
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(p: int, gen: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in engine_errors(gen):
                    merged.put_nowait((p, out))
            except Exception as exc:
                merged.put_nowait((p, exc))

        tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                p, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                yield p, item
                remaining -= item.finished
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self, job: Job, raw: Request | None) -> list[RequestOutput] | None:
        """Final outputs of every prompt, or None if the client went away first (aborted).

        `raw` None: no client connection to watch (a batch line; cancelling the task aborts)."""

        seen: dict[int, RequestOutput] = {}

        async def last_of(p: int, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
            async for out in engine_errors(gen):
                seen[p] = out
            assert seen[p].finished
            return seen[p]

        tasks = [asyncio.create_task(last_of(p, g)) for p, g in enumerate(self._generators(job))]
        watcher = asyncio.create_task(_wait_disconnect(raw) if raw is not None else asyncio.Event().wait())
        try:
            pending: set[asyncio.Task[Any]] = {*tasks, watcher}
            while not all(t.done() for t in tasks):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return None  # the client left: the finally below aborts its requests
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            unfinished = [t for t in (*tasks, watcher) if not t.done()]
            for t in unfinished:
                t.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
            job.settle(seen.values())
            self._done(job)

    def token_text(self, token_id: int) -> str:
        """A token's text as it reads inside a sequence (with its leading space).

        Decoding a token alone drops a SentencePiece word-start space, so decode it after a
        fixed anchor token and keep only what it adds.
        """
        text = self._token_text.get(token_id)
        if text is None:
            anchor = self._anchor
            text = self.tokenizer.decode([*anchor, token_id])[len(self.tokenizer.decode(anchor)) :]
            self._token_text[token_id] = text
        return text


async def engine_errors(gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Engine-side failures as API errors."""
    try:
        async for out in gen:
            yield out
    except RequestRefused as exc:  # a tier rule (the queue is too long for its targets), a peer gone
        retry = str(max(1, math.ceil(exc.retry_after)))
        raise APIError(exc.status, str(exc), code=exc.code, headers={"Retry-After": retry}) from exc
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from exc


async def _wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events: one `data:` line per event, an error mid-stream as an error event
    (the status line has gone already), then `[DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(error_body(exc.status, exc.message, exc.param, exc.code))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

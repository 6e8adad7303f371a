"""The engine on its own thread, driven from asyncio: the server's view of an Engine.

The step loop runs on a dedicated thread, so the HTTP side never waits for a step and a
step never waits for HTTP work; model compute releases the GIL, so the event loop keeps
serving sockets while the model runs. Requests and aborts reach the loop through a queue
and are applied between steps; each step's outputs go back to the event loop in one
call, where they are fanned out to per-request asyncio queues.

Tokenization happens before `generate` (the server tokenizes in a worker thread);
detokenization stays in the step loop because it is incremental and costs O(1) per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.outputs import RequestOutput
from dolmus.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server's front end uses this module's helpers without the engine's imports
    from dolmus.engine.engine import Engine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped; no request can be served any more."""


@dataclass
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # when the server got it, so queue time includes waiting for a step


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Summaries:
    """Asks the step thread for the request list (read between steps, never during one)."""

    future: asyncio.Future[list[RequestSummary]]


@dataclass
class _ResetPrefixCache:
    """Asks the step thread to forget the cached prefixes (between steps, only when idle)."""

    future: asyncio.Future[bool]


_STOP = object()

OutputHook = Callable[[RequestOutput], None]


class AsyncEngine:
    """Runs `engine.step()` in a background thread while requests are in flight.

    `on_finished` is called on the step thread with each finished output (the metrics
    module observes latencies there, so aborted streams do not skew what is recorded).
    """

    def __init__(self, engine: Engine, on_finished: OutputHook | None = None) -> None:
        self.engine = engine
        self._on_finished = on_finished
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending_adds = 0  # added on the event loop, not yet seen by the step thread
        self._stats = engine.stats()
        # The step thread takes its snapshot of the engine and stops counting the adds it
        # applied as pending in one move: done apart (the uncount a callback on the loop), a
        # request the snapshot already counted was counted twice meanwhile, and admission
        # control refused a request with one sequence waiting under --max-waiting 2.
        self._count_lock = threading.Lock()
        self._error: BaseException | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread; must be called from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dolmus-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the step thread."""
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.to_thread(self.engine.shutdown)  # executor workers, KV event sockets

    @property
    def is_running(self) -> bool:
        """False once the step loop died or the executor lost a worker (checked even while idle)."""
        return self._thread is not None and self._error is None and self.engine.is_healthy()

    # -- what the server reads ------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (never read from the live engine)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for a seat, including those added since the latest step."""
        with self._count_lock:
            return self._stats.num_waiting + self._pending_adds

    # -- requests -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps make them; the last one has `finished`.

        Leaving the iteration early (client gone, task cancelled) aborts the request, which
        frees its KV blocks before the next step.
        """
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        with self._count_lock:
            self._pending_adds += params.n
        self._inbox.put(_Add(request_id, prompt, params, priority, time.monotonic()))

        def leave(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

        async with contextlib.aclosing(stream_outputs(stream, leave)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def request_summaries(self) -> list[RequestSummary]:
        """The sequences in the engine now, read by the step thread between steps."""
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running")
        future: asyncio.Future[list[RequestSummary]] = asyncio.get_running_loop().create_future()
        self._inbox.put(_Summaries(future))
        return await future

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while requests are in the engine."""
        if self._error is not None or self._thread is None:
            raise EngineDeadError("the engine is not running")
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._inbox.put(_ResetPrefixCache(future))
        return await future

    # -- the step thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                # Block while idle; otherwise take whatever arrived during the last step.
                items = [self._inbox.get()] if not engine.has_unfinished_requests() else []
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if not self._apply(items):
                    return
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
                if self._on_finished is not None:
                    for out in outputs:
                        if out.finished:
                            self._on_finished(out)
                self._stats = engine.stats()
                refusals: list[tuple[str, BaseException]] = list(engine.take_refusals())
                if outputs or refusals:
                    self._call_soon(self._deliver, outputs, refusals)
        except BaseException as exc:  # a bug in a step: fail every request, loudly
            logger.exception("engine step loop died")
            self._error = exc
            self._call_soon(self._fail_all, EngineDeadError(f"engine failed: {exc!r}"))
        finally:
            engine.abort_all()  # whatever is still in the engine is abandoned with the thread

    def _apply(self, items: list[object]) -> bool:
        """Apply queued commands in order; False means stop."""
        added = 0
        errors: list[tuple[str, BaseException]] = []
        for item in items:
            if item is _STOP:
                return False
            if isinstance(item, _Add):
                added += item.params.n
                try:
                    self.engine.add_request(
                        item.request_id, item.prompt, item.params, item.priority, item.arrival_time
                    )
                except ValueError as exc:
                    errors.append((item.request_id, exc))
            elif isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
            elif isinstance(item, _Summaries):
                self._call_soon(_resolve, item.future, self.engine.request_summaries())
            elif isinstance(item, _ResetPrefixCache):
                self._call_soon(_resolve, item.future, self.engine.reset_prefix_cache())
        if items:
            # The snapshot now counts the new requests, so they stop counting as pending.
            with self._count_lock:
                self._stats = self.engine.stats()
                self._pending_adds -= added
        if errors:
            self._call_soon(self._deliver, [], errors)
        return True

    def _call_soon(self, fn: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # loop closed between the check and the call
                pass

    # -- back on the event loop -----------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput], errors: list[tuple[str, BaseException]]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)
        for rid, exc in errors:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)


async def stream_outputs(
    stream: asyncio.Queue[RequestOutput | BaseException], leave: Callable[[bool], None]
) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its queue until the finished one; `leave(finished)` at the end.

    A consumer that fell behind gets one output for all the steps it missed (one SSE chunk
    instead of many), so slow clients cost less, not more. `leave` is called however the
    iteration ends (finished, failed, or abandoned by the client: then it aborts).
    """
    finished = False
    try:
        while True:
            item = await stream.get()
            while isinstance(item, RequestOutput) and not stream.empty():
                newer = stream.get_nowait()
                item = newer if isinstance(newer, BaseException) else coalesce(item, newer)
            if isinstance(item, BaseException):
                finished = True  # the engine already dropped it
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        leave(finished)


def coalesce(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` carrying the text deltas of both (everything else in it is cumulative)."""
    for old, new in zip(older.outputs, newer.outputs):
        new.text_delta = old.text_delta + new.text_delta
    return newer


def _resolve(future: asyncio.Future[Any], value: object) -> None:
    if not future.done():  # the asking handler may have been cancelled meanwhile
        future.set_result(value)

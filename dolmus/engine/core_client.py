"""The API server's side of an engine core process: the AsyncEngine interface over ZeroMQ.

`generate` queues a request with the core and yields its outputs as the core's messages
arrive; a reader task fans each message out to per-request streams. A watcher thread turns
the core process's exit into EngineDeadError for every stream (and `is_running` False, so
/health answers 503), never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from dolmus.config import EngineConfig, ModelConfig
from dolmus.engine.admission import RequestRefused
from dolmus.engine.async_engine import EngineDeadError, stream_outputs
from dolmus.engine.core_launch import CoreLaunch, launch_core
from dolmus.engine.core_protocol import (
    AbortRequest,
    AddRequest,
    CoreDied,
    ListRequests,
    LoadFailed,
    PrefixCacheReset,
    Ready,
    RequestList,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    from_core_decoder,
    to_core_encoder,
)
from dolmus.engine.output_delta import OutputAssembler
from dolmus.engine.stats import EngineStats, RequestSummary
from dolmus.engine.tokenizing import load_tokenizer
from dolmus.outputs import RequestOutput
from dolmus.sampling_params import SamplingParams
from dolmus.structured.backend import GrammarCache, make_backend

logger = logging.getLogger(__name__)

_SHUTDOWN_WAIT_S = 10.0
_SEND_WAIT_S = 1.0

OutputHook = Callable[[RequestOutput], None]


@dataclass
class FrontEnd:
    """What the API server reads of the engine, held in its own process."""

    tokenizer: Any
    max_model_len: int
    model_config: ModelConfig
    grammars: GrammarCache  # validates (and compiles) specs here; the core compiles its own copy


class EngineCoreClient:
    """Starts the engine core process and talks to it; the same interface as AsyncEngine."""

    def __init__(
        self,
        config: EngineConfig,
        on_finished: OutputHook | None = None,
        cpus: list[int] | None = None,
        visible_gpus: str | None = None,
        launched: CoreLaunch | None = None,
    ) -> None:
        """`cpus`, `visible_gpus`: the core's share of the host (a data-parallel replica's).
        `launched`: a core already started for `config` (core_launch.py), taken over here."""
        self.config = config
        self._on_finished = on_finished
        self._placement = (cpus, visible_gpus)
        self._launch = launched
        self._ctx = zmq.asyncio.Context()
        self._inbox = self._ctx.socket(zmq.PUSH)  # to the core
        self._outbox = self._ctx.socket(zmq.PULL)  # from the core
        self._reader: asyncio.Task[None] | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending_adds = 0
        self._assembler = OutputAssembler()
        self._stats: EngineStats | None = None
        self._error: str | None = None
        self._closing = False
        # token -> waiting asker (a request list, or whether a prefix-cache reset happened)
        self._lists: dict[int, asyncio.Future[Any]] = {}
        self._next_token = 0
        self.engine: FrontEnd | None = None

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the core and wait until its model is loaded; ValueError if it fails to load."""
        mc = ModelConfig.from_dir(self.config.model_path)
        # The core starts first (if it was not started already): its imports and model load
        # (seconds) overlap the tokenizer's. It connects to these sockets whenever it gets there.
        if self._launch is None:
            self._launch = launch_core(self.config, *self._placement)
        self._inbox.bind(self._launch.inbox)
        self._outbox.bind(self._launch.outbox)
        loop = asyncio.get_running_loop()
        threading.Thread(target=self._watch, args=(loop,), name="dolmus-core-watch", daemon=True).start()
        try:
            tokenizer = await asyncio.to_thread(
                load_tokenizer, str(self.config.tokenizer or self.config.model_path)
            )
            while True:
                msg = from_core_decoder.decode(await self._recv_or_death())
                if isinstance(msg, LoadFailed):
                    raise ValueError(msg.message)
                if isinstance(msg, Ready):
                    break
        except BaseException:
            # a failed load, or the server stopping meanwhile (the port was taken): the core
            # goes too (left running, a non-daemon child held the exit up forever)
            await asyncio.shield(self.shutdown())
            raise
        self._stats = msg.stats
        backend = self.config.structured_output_backend
        grammars = GrammarCache(lambda: make_backend(backend, tokenizer, mc.vocab_size, mc.eos_token_ids))
        self.engine = FrontEnd(tokenizer, msg.max_model_len, mc, grammars)
        self._reader = asyncio.create_task(self._read())

    async def _recv_or_death(self) -> bytes:
        while True:
            if await self._outbox.poll(200):
                return await self._outbox.recv()
            if self._error is not None:
                raise ValueError(f"the engine core exited while loading: {self._error}")

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._launch is not None
        proc = self._launch.proc
        proc.join()
        if self._closing:
            return
        self._error = f"the engine core process exited with code {proc.exitcode}"
        logger.error("%s", self._error)
        try:
            loop.call_soon_threadsafe(self._fail_all, EngineDeadError(self._error))
        except RuntimeError:  # the loop is closed
            pass

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the core (killing it if it does not stop), clean up."""
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()
        proc = self._launch.proc if self._launch is not None else None
        if proc is not None and proc.is_alive():
            try:
                # bounded: a core that is exiting (it failed to load) has no peer left for a
                # PUSH socket, where an unbounded send would wait forever
                await asyncio.wait_for(self._inbox.send(to_core_encoder.encode(Shutdown())), _SEND_WAIT_S)
            except (zmq.ZMQError, TimeoutError):
                pass
            await asyncio.to_thread(proc.join, _SHUTDOWN_WAIT_S)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._inbox.close(linger=0)
        self._outbox.close(linger=0)
        self._ctx.term()
        if self._launch is not None:
            self._launch.stop()  # the folder of the sockets (the process is gone by now)

    @property
    def is_running(self) -> bool:
        return self.engine is not None and self._error is None and not self._closing

    # -- what the server reads ------------------------------------------------------------

    @property
    def stats(self) -> EngineStats:
        assert self._stats is not None
        return self._stats

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting + self._pending_adds

    # -- requests -------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as steps make them; leaving early aborts it in the core."""
        if not self.is_running:
            raise EngineDeadError(self._error or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._pending_adds += params.n
        prompt = prompt if isinstance(prompt, str) else list(prompt)
        add = AddRequest(request_id, prompt, params, priority, time.monotonic())
        await self._inbox.send(to_core_encoder.encode(add))

        def leave(finished: bool) -> None:
            self._streams.pop(request_id, None)
            if not finished:
                self._assembler.forget(request_id)
                self.abort(request_id)

        async with contextlib.aclosing(stream_outputs(stream, leave)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        if self._closing:
            return
        try:
            self._inbox.send(to_core_encoder.encode(AbortRequest(request_id)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def request_summaries(self) -> list[RequestSummary]:
        """The sequences in the core's engine now (the core answers between steps)."""
        return await self._ask(ListRequests)

    async def reset_prefix_cache(self) -> bool:
        """Forget the core's cached prefixes; False while requests are in its engine."""
        return await self._ask(ResetPrefixCache)

    async def _ask(self, kind: type[ListRequests] | type[ResetPrefixCache]) -> Any:
        """Send a question the core answers between steps, and wait for its answer."""
        if not self.is_running:
            raise EngineDeadError(self._error or "the engine is not running")
        self._next_token += 1
        token = self._next_token
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._lists[token] = future
        try:
            await self._inbox.send(to_core_encoder.encode(kind(token)))
            return await future
        finally:
            self._lists.pop(token, None)

    # -- the reader task ------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            msg = from_core_decoder.decode(await self._outbox.recv())
            if isinstance(msg, CoreDied):
                self._error = msg.message
                logger.error("engine core: %s", msg.message)
                self._fail_all(EngineDeadError(msg.message.splitlines()[0]))
                return
            if isinstance(msg, RequestList | PrefixCacheReset):
                future = self._lists.get(msg.token)
                if future is not None and not future.done():
                    future.set_result(msg.requests if isinstance(msg, RequestList) else msg.done)
                continue
            if not isinstance(msg, StepOutputs):
                continue
            self._stats = msg.stats
            self._pending_adds -= msg.num_applied_adds
            for delta in msg.outputs:
                out = self._assembler.assemble(delta)
                if out is None:
                    continue  # its stream left; the core has its abort on the way
                if out.finished and self._on_finished is not None:
                    self._on_finished(out)
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
            for error in msg.errors:
                stream = self._streams.get(error.request_id)
                if stream is not None:
                    if error.code is not None:
                        retry = error.retry_after or 1.0
                        refusal = RequestRefused(error.message, error.code, retry, error.status)
                        stream.put_nowait(refusal)
                    else:
                        stream.put_nowait(ValueError(error.message))

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(exc)
        for future in self._lists.values():
            if not future.done():
                future.set_exception(exc)

"""The engine core in its own process: the step loop, fed and drained over ZeroMQ.

As in vLLM v1, the API server's HTTP and SSE work runs in another interpreter, so it never
competes with the step loop for the GIL. The loop takes every queued command between steps,
runs a step whenever there is work, and sends one message per step with the outputs and a
stats snapshot. Grammars are compiled on a worker thread before their request enters the
engine, so a large schema never stalls a step.
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import os
import signal
import traceback

import zmq

from dolmus.config import EngineConfig
from dolmus.engine.admission import RequestRefused
from dolmus.engine.core_protocol import (
    AbortRequest,
    AddRequest,
    CoreDied,
    ListRequests,
    LoadFailed,
    PrefixCacheReset,
    Ready,
    RequestError,
    RequestList,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    from_core_encoder,
    to_core_decoder,
)
from dolmus.engine.engine import Engine
from dolmus.engine.request_group import RequestGroup
from dolmus.executor.worker import die_with_parent, name_process

logger = logging.getLogger(__name__)

_COMPILE_POLL_MS = 5  # while grammars compile, how often an idle loop looks for them
_HEALTH_POLL_MS = 1000  # how often an idle loop checks that the executor's ranks are alive


def run_engine_core(
    config: EngineConfig,
    inbox_addr: str,
    outbox_addr: str,
    log_level: int,
    cpus: list[int] | None = None,
    visible_gpus: str | None = None,
) -> None:
    """Process entry point: load the engine, then serve commands until Shutdown. `cpus` and
    `visible_gpus` confine it (and the rank processes it starts) to a share of the host."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if visible_gpus is not None:  # before anything touches CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus
    die_with_parent()  # the API server's exit takes the core (and the model's memory) along
    name_process("dolmus-core")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C and SIGTERM are the API server's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(inbox_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(outbox_addr)
    try:
        engine = Engine(config, progress=True)
    except Exception as exc:
        outbox.send(from_core_encoder.encode(LoadFailed(str(exc))))
        outbox.close(linger=2000)
        inbox.close(linger=0)
        ctx.term()
        return
    # The model, tokenizer and libraries are hundreds of thousands of objects that live as long
    # as the process: out of the collector's sight, a full collection no longer walks them
    # (those took 30-150 ms every few seconds here, and a step or a stream waited on them).
    gc.collect()
    gc.freeze()
    outbox.send(from_core_encoder.encode(Ready(engine.max_model_len, engine.stats())))
    try:
        _CoreLoop(engine, inbox, outbox).run()
    except BaseException as exc:
        logger.exception("engine core died")
        outbox.send(from_core_encoder.encode(CoreDied(f"engine failed: {exc!r}\n{traceback.format_exc()}")))
    finally:
        engine.shutdown()
        inbox.close(linger=0)
        outbox.close(linger=2000)
        ctx.term()


class _CoreLoop:
    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dolmus-grammar")
        self.compiling: list[tuple[AddRequest, concurrent.futures.Future]] = []
        self.errors: list[RequestError] = []
        self.added = 0
        self.applied = False  # a command changed the engine since the last message

    def run(self) -> None:
        while True:
            if not self._take_commands():
                return
            self._admit_compiled()
            groups = self.engine.step_groups() if self.engine.has_unfinished_requests() else []
            for rid, refusal in self.engine.take_refusals():
                self.errors.append(_error(rid, refusal))
            if groups or self.errors or self.added or self.applied:
                self._send(groups)  # an abort on an idle engine still needs a fresh snapshot

    def _take_commands(self) -> bool:
        """Apply queued commands; block while there is nothing else to do. False: shut down."""
        idle = not self.engine.has_unfinished_requests()
        timeout = (_COMPILE_POLL_MS if self.compiling else _HEALTH_POLL_MS) if idle else 0
        while True:
            if timeout != 0 and not self.inbox.poll(timeout):
                # A rank that died while the engine idles ends the core now (so /health says
                # 503), not at the next request.
                self.engine.executor.check_health()
                return True
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            timeout = 0  # after the first command, take only what is already there
            self.applied = True
            msg = to_core_decoder.decode(data)
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, AbortRequest):
                self._abort(msg.request_id)
            elif isinstance(msg, ListRequests):
                reply = RequestList(msg.token, self.engine.request_summaries())
                self.outbox.send(from_core_encoder.encode(reply))
            elif isinstance(msg, ResetPrefixCache):
                done = self.engine.reset_prefix_cache()
                self.outbox.send(from_core_encoder.encode(PrefixCacheReset(msg.token, done)))
            else:
                self._add(msg)

    def _add(self, msg: AddRequest) -> None:
        spec = msg.params.structured_output
        if spec is not None:
            self.compiling.append((msg, self.compiler.submit(self.engine.grammars.compile, spec)))
            return
        self._add_now(msg)

    def _add_now(self, msg: AddRequest) -> None:
        self.added += msg.params.n
        try:
            self.engine.add_request(msg.request_id, msg.prompt, msg.params, msg.priority, msg.arrival_time)
        except ValueError as exc:
            self.errors.append(_error(msg.request_id, exc))

    def _admit_compiled(self) -> None:
        still = []
        for msg, future in self.compiling:
            if not future.done():
                still.append((msg, future))
            elif future.exception() is not None:
                self.added += msg.params.n
                self.errors.append(RequestError(msg.request_id, str(future.exception())))
            else:
                self._add_now(msg)  # compiled and cached: new_state is cheap now
        self.compiling = still

    def _abort(self, request_id: str) -> None:
        for msg, future in self.compiling:
            if msg.request_id == request_id:  # never reached the engine: count it as settled
                future.cancel()
                self.compiling.remove((msg, future))
                self.added += msg.params.n
                return
        self.engine.abort_request(request_id)

    def _send(self, groups: list[RequestGroup]) -> None:
        self.outbox.send(step_message(self.engine, groups, self.errors, self.added))
        self.errors, self.added, self.applied = [], 0, False


def step_message(
    engine: Engine, groups: list[RequestGroup], errors: list[RequestError], num_applied_adds: int
) -> bytes:
    """What one pass of the loop sends: each moved-on request's delta, refusals, a snapshot."""
    return from_core_encoder.encode(
        StepOutputs([g.delta() for g in groups], errors, num_applied_adds, engine.stats())
    )


def _error(request_id: str, exc: ValueError) -> RequestError:
    if isinstance(exc, RequestRefused):
        return RequestError(request_id, str(exc), exc.code, exc.retry_after, exc.status)
    return RequestError(request_id, str(exc))

"""Running batch jobs: each input line through the same API module as its HTTP endpoint.

A line is parsed into the endpoint's pydantic body and handed to OpenAIChat / OpenAICompletions
`create` (no client connection to watch), so a batch line is checked, admitted and answered
exactly as the same body sent to /v1/chat/completions would be. Every request of a batch runs at
the least urgent priority of the server's tiers, so interactive traffic goes first; all jobs
together keep at most `max_in_flight` lines in the engine, so neither a 50 000-line file nor many
jobs at once flood the queue.

A line that cannot run (not JSON, another endpoint, a body the endpoint refuses) becomes a line
of the job's error file and counts as failed; the job itself goes on. A full waiting queue (429)
is waited out, not recorded. Finished lines are appended to the output or error file at once,
and a resumed job skips the line ids already there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dolmus.server.errors import APIError, error_body, validation_error
from dolmus.server.openai.batch_store import BatchStore
from dolmus.server.openai.chat import OpenAIChat
from dolmus.server.openai.completions import OpenAICompletions
from dolmus.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_BUSY_RETRY_S = 1.0  # wait before resubmitting a line the waiting queue refused (429)


@dataclass
class BatchTarget:
    """Where batch lines go: the API modules of the server (or of `dolmus run-batch`)."""

    chat: OpenAIChat
    completions: OpenAICompletions
    priority: int  # the least urgent tier's
    max_in_flight: int  # lines of all jobs in the engine at once


async def execute(target: BatchTarget, endpoint: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One request body through the endpoint's API module: (HTTP status, response body)."""
    model = ChatCompletionRequest if endpoint == "/v1/chat/completions" else CompletionRequest
    api: Any = target.chat if endpoint == "/v1/chat/completions" else target.completions
    try:
        parsed = model.model_validate(body)
        if parsed.stream:
            raise APIError(400, "stream is not supported in a batch", param="stream")
        while True:
            try:
                response = await api.create(parsed, target.priority, None, None)
                break
            except APIError as exc:
                if exc.status != 429 or exc.code != "rate_limit_exceeded":
                    raise
                await asyncio.sleep(_BUSY_RETRY_S)
    except ValidationError as exc:
        err = validation_error(exc.errors())
        return err.status, error_body(err.status, err.message, err.param, err.code)
    except APIError as exc:
        if exc.status == 503:
            raise  # the engine is gone: the job stops here and resumes with the server
        return exc.status, error_body(exc.status, exc.message, exc.param, exc.code)
    except Exception as exc:  # as the HTTP server's 500: this line fails, the job goes on
        logger.exception("batch line failed")
        return 500, error_body(500, f"internal error: {exc!r}")
    return response.status_code, json.loads(response.body)


async def run_line(
    target: BatchTarget, endpoints: tuple[str, ...], line_id: str, raw: str
) -> tuple[bool, dict[str, Any]]:
    """(succeeded, the output line in OpenAI's batch format) for one input line, whose `url`
    must be one of `endpoints` (a server batch's one; any, offline)."""
    custom_id = None
    try:
        try:
            request = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the line is not valid JSON: {exc}") from exc
        if not isinstance(request, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = request.get("custom_id")
        if request.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {request.get('method')!r}")
        if request.get("url") not in endpoints:
            raise ValueError(f"url must be {' or '.join(endpoints)}, got {request.get('url')!r}")
        if not isinstance(request.get("body"), dict):
            raise ValueError("body must be a JSON object")
    except ValueError as exc:
        error = {"code": "invalid_request", "message": str(exc)}
        return False, {"id": line_id, "custom_id": custom_id, "response": None, "error": error}
    status, body = await execute(target, request["url"], request["body"])
    response = {"status_code": status, "request_id": body.get("id", line_id), "body": body}
    return status == 200, {"id": line_id, "custom_id": custom_id, "response": response, "error": None}


def input_lines(store: BatchStore, file_id: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of an input file."""
    text = store.data_path(file_id).read_bytes().decode("utf-8", errors="replace")
    return [(i, line) for i, line in enumerate(text.split("\n")) if line.strip()]


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as OpenAI shows it (our bookkeeping fields start with `_`)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}


class BatchRunner:
    """One asyncio task per running job; the jobs' live records (counts) in memory."""

    def __init__(self, store: BatchStore, target: Callable[[], BatchTarget]) -> None:
        self.store = store
        self._target = target
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._live: dict[str, dict[str, Any]] = {}  # the record of each running job, counts current
        self._slots: asyncio.Semaphore | None = None  # shared by every job, made with the first

    def batch(self, batch_id: str) -> dict[str, Any]:
        live = self._live.get(batch_id)
        return dict(live) if live is not None else self.store.batch(batch_id)

    def start(self, batch: dict[str, Any]) -> None:
        self._live[batch["id"]] = batch
        task = self._tasks[batch["id"]] = asyncio.create_task(self._run(batch))

        def ended(_: asyncio.Task[None]) -> None:
            # here, not in _run: a task cancelled before its first step never runs its body
            if batch["status"] == "cancelling":
                self._finish(batch, "cancelled")

        task.add_done_callback(ended)

    def resume_all(self) -> None:
        """Pick up the jobs a stopped server left unfinished (their done lines stay done)."""
        for batch in self.store.batches():
            if batch["status"] in ("validating", "in_progress", "finalizing"):
                logger.info("resuming batch %s", batch["id"])
                self.start(batch)
            elif batch["status"] == "cancelling":
                self._finish(batch, "cancelled")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        live = self._live.get(batch_id)  # the running job's own record, changed in place
        batch = live if live is not None else self.store.batch(batch_id)
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            return dict(batch)
        batch["status"], batch["cancelling_at"] = "cancelling", int(time.time())
        self.store.save_batch(batch)
        task = self._tasks.get(batch_id)
        if task is None or task.done():
            self._finish(batch, "cancelled")
        else:
            task.cancel()  # `ended` records it as cancelled once its requests are aborted
        return dict(batch)

    async def close(self) -> None:
        """Stop every job where it is (a server shutting down): they resume on the next start."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _finish(self, batch: dict[str, Any], status: str) -> None:
        now = int(time.time())
        batch["status"] = status
        batch[f"{status}_at"] = now
        counts = batch["request_counts"]
        batch["output_file_id"] = batch["_output"] if counts["completed"] or status == "completed" else None
        batch["error_file_id"] = batch["_errors"] if counts["failed"] else None
        self.store.save_batch(batch)
        self._live.pop(batch["id"], None)
        self._tasks.pop(batch["id"], None)

    async def _run(self, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        out_id, err_id = batch["_output"], batch["_errors"]
        # file work off the event loop: it serves HTTP (and, with --engine-core thread, steps)
        done_ok = await asyncio.to_thread(self.store.done_line_ids, out_id)
        done_failed = await asyncio.to_thread(self.store.done_line_ids, err_id)
        lines = await asyncio.to_thread(input_lines, self.store, batch["input_file_id"])
        batch["request_counts"] = {"total": len(lines), "completed": len(done_ok), "failed": len(done_failed)}
        if batch["status"] == "validating":
            batch["status"], batch["in_progress_at"] = "in_progress", int(time.time())
        self.store.save_batch(batch)
        target = self._target()
        if self._slots is None:
            self._slots = asyncio.Semaphore(target.max_in_flight)
        slots = self._slots
        running: set[asyncio.Task[None]] = set()
        appending = asyncio.Lock()  # one writer per file at a time: lines never interleave

        async def one(line_id: str, raw: str) -> None:
            ok, line = await run_line(target, (batch["endpoint"],), line_id, raw)
            async with appending:
                batch["request_counts"]["completed" if ok else "failed"] += 1
                write = asyncio.ensure_future(
                    asyncio.to_thread(self.store.append_lines, out_id if ok else err_id, [line])
                )
                try:
                    await asyncio.shield(write)
                except asyncio.CancelledError:  # a counted line is written before the job stops
                    await write
                    raise

        stem = batch_id.removeprefix("batch_")
        try:
            for index, raw in lines:
                line_id = f"batch_req_{stem}_{index}"
                if line_id in done_ok or line_id in done_failed:
                    continue
                await slots.acquire()
                task = asyncio.create_task(one(line_id, raw))
                running.add(task)
                task.add_done_callback(running.discard)
                # on the task, not in `one`: a line cancelled before it started gives its slot back too
                task.add_done_callback(lambda _: slots.release())
            while running:
                await asyncio.gather(*running)
            batch["status"], batch["finalizing_at"] = "finalizing", int(time.time())
            self._finish(batch, "completed")
        except asyncio.CancelledError:  # cancelled, or the server is stopping
            await _cancel_all(running)
            raise
        except APIError as exc:  # 503: the engine stopped; the job resumes with the next server
            await _cancel_all(running)
            logger.warning("batch %s paused: %s", batch_id, exc.message)
        except Exception as exc:  # an unreadable input file: nothing to resume
            await _cancel_all(running)
            logger.exception("batch %s failed", batch_id)
            batch["errors"] = {"object": "list", "data": [{"code": "internal_error", "message": repr(exc)}]}
            self._finish(batch, "failed")


async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    with contextlib.suppress(Exception):
        await asyncio.gather(*tasks, return_exceptions=True)

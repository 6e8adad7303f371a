"""OpenAI's Files API (purpose `batch`) and Batch API, as routes over the batch store and runner.

`client.files.create(file=..., purpose="batch")`, `client.batches.create/retrieve/cancel/list`
and `client.files.content(...)` of the `openai` package work unchanged. The input file is checked
when uploaded and when a batch is created (size by --max-body-bytes, at most MAX_FILE_LINES
lines, unique custom_ids); each line is then checked as its endpoint checks a request, and a bad
line fails alone (server/openai/batch_runner.py). Jobs and files live in --batch-dir, so a
restarted server resumes its unfinished jobs.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import time
import uuid
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from dolmus.server.errors import APIError
from dolmus.server.openai.batch_runner import ENDPOINTS, BatchRunner, public
from dolmus.server.openai.batch_store import MAX_FILE_LINES, BatchStore

_WINDOW_S = 24 * 3600
_PURPOSES = ("batch",)


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


def _multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """The parts of a multipart/form-data body: name -> (filename, bytes). The stdlib's MIME
    parser reads it, so the server needs no python-multipart."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise APIError(400, "upload the file as multipart/form-data with fields `file` and `purpose`")
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    parts: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            parts[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return parts


def check_input(data: bytes) -> list[str | None]:
    """The custom_ids of an input file's lines (None where unreadable); a 400 for a file that
    is not UTF-8 text, has too many lines or repeats a custom_id."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the file is not UTF-8 text: {exc}", param="file") from exc
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) > MAX_FILE_LINES:
        raise APIError(
            400, f"the file has {len(lines)} lines; a batch takes at most {MAX_FILE_LINES}", param="file"
        )
    ids: list[str | None] = []
    seen: dict[str, int] = {}
    for i, line in enumerate(lines, 1):
        try:
            custom_id = json.loads(line).get("custom_id")
        except (ValueError, AttributeError):
            custom_id = None  # a bad line fails alone when the batch runs
        if isinstance(custom_id, str):
            if custom_id in seen:
                raise APIError(
                    400,
                    f"custom_id {custom_id!r} is on lines {seen[custom_id]} and {i}: custom_ids must differ",
                    param="file",
                )
            seen[custom_id] = i
        ids.append(custom_id if isinstance(custom_id, str) else None)
    return ids


def add_batch_routes(app: FastAPI, store: BatchStore, runner: BatchRunner, ready: Any) -> None:
    """`ready()` raises the server's 503 while the model is loading (batches need the engine)."""

    def file_or_404(file_id: str) -> dict[str, Any]:
        try:
            return store.file(file_id)
        except KeyError:
            raise APIError(404, f"no file with id {file_id!r}", param="file_id") from None

    def batch_or_404(batch_id: str) -> dict[str, Any]:
        try:
            return runner.batch(batch_id)
        except KeyError:
            raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id") from None

    @app.post("/v1/files")
    async def upload(raw: Request) -> Response:
        parts = _multipart(raw.headers.get("content-type", ""), await raw.body())
        if "file" not in parts:
            raise APIError(400, "the upload has no `file` field", param="file")
        purpose = parts.get("purpose", (None, b""))[1].decode("utf-8", "replace")
        if purpose not in _PURPOSES:
            raise APIError(
                400, f"purpose must be one of {', '.join(_PURPOSES)}, got {purpose!r}", param="purpose"
            )
        filename, data = parts["file"]
        check_input(data)
        meta = await asyncio.to_thread(store.add_file, data, filename or "upload.jsonl", purpose)
        return JSONResponse(meta)

    @app.get("/v1/files")
    async def list_files() -> Response:
        return JSONResponse({"object": "list", "data": store.files(), "has_more": False})

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str) -> Response:
        return JSONResponse(file_or_404(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str) -> Response:
        file_or_404(file_id)
        data = await asyncio.to_thread(store.data_path(file_id).read_bytes)
        return Response(data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str) -> Response:
        file_or_404(file_id)
        store.delete_file(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatchRequest) -> Response:
        ready()
        source = file_or_404(body.input_file_id)
        if source["purpose"] != "batch":
            raise APIError(400, "the input file's purpose must be batch", param="input_file_id")
        if body.endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if body.completion_window != "24h":
            raise APIError(400, "completion_window must be 24h", param="completion_window")
        data = await asyncio.to_thread(store.data_path(body.input_file_id).read_bytes)
        total = len(check_input(data))
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = int(time.time())
        batch: dict[str, Any] = {
            "id": batch_id,
            "object": "batch",
            "endpoint": body.endpoint,
            "errors": None,
            "input_file_id": body.input_file_id,
            "completion_window": body.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + _WINDOW_S,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": total, "completed": 0, "failed": 0},
            "metadata": body.metadata,
            "_output": store.new_output_file(f"{batch_id}_output.jsonl"),
            "_errors": store.new_output_file(f"{batch_id}_error.jsonl"),
        }
        store.save_batch(batch)
        runner.start(batch)
        return JSONResponse(public(batch))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str) -> Response:
        return JSONResponse(public(batch_or_404(batch_id)))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str) -> Response:
        batch_or_404(batch_id)
        return JSONResponse(public(runner.cancel(batch_id)))

    @app.get("/v1/batches")
    async def list_batches(limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Response:
        batches = [public(runner.batch(b["id"])) for b in store.batches()]
        if after is not None:
            ids = [b["id"] for b in batches]
            batches = batches[ids.index(after) + 1 :] if after in ids else []
        page = batches[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(batches) > limit,
            }
        )

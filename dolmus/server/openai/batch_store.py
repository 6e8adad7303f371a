"""Files and batch jobs on disk, for OpenAI's Files and Batch APIs (server/openai/batches.py).

Layout under the batch directory (`dolmus serve --batch-dir DIR`, or a temporary one per
server): `files/<id>` holds a file's bytes and `files/<id>.json` its metadata; `batches/<id>.json`
a job's record. Records are written whole to a temporary file and renamed over the old one, so a
crash leaves the old record or the new one, never half of either. Output lines are appended as
requests finish, so a restarted server knows what is done by reading them back
(`done_line_ids`); a line cut short by a crash is dropped then.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

MAX_FILE_LINES = 50_000  # OpenAI's limit of requests per batch input file
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # statuses a restart picks up


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class BatchStore:
    """Every file and batch record of one batch directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        for stale in [*self.files_dir.glob("*.tmp"), *self.batches_dir.glob("*.tmp")]:
            stale.unlink(missing_ok=True)  # a record being replaced when the server died

    # -- files ----------------------------------------------------------------------------

    def _meta_path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise KeyError(file_id)
        return self.files_dir / f"{file_id}.json"

    def data_path(self, file_id: str) -> Path:
        self._meta_path(file_id)  # the same check on the id
        return self.files_dir / file_id

    def add_file(self, data: bytes, filename: str, purpose: str) -> dict[str, Any]:
        file_id = new_id("file")
        self.data_path(file_id).write_bytes(data)
        meta = {"id": file_id, "object": "file", "created_at": int(time.time()), "filename": filename}
        meta.update({"purpose": purpose, "status": "processed", "status_details": None})
        _write_atomic(self._meta_path(file_id), meta)
        return self.file(file_id)

    def new_output_file(self, filename: str) -> str:
        """An empty output file (purpose batch_output) that a job appends its lines to."""
        file_id = new_id("file")
        self.data_path(file_id).touch()
        meta = {"id": file_id, "object": "file", "created_at": int(time.time()), "filename": filename}
        meta.update({"purpose": "batch_output", "status": "processed", "status_details": None})
        _write_atomic(self._meta_path(file_id), meta)
        return file_id

    def file(self, file_id: str) -> dict[str, Any]:
        """The file's metadata with its current size; KeyError if there is no such file."""
        try:
            meta = json.loads(self._meta_path(file_id).read_text())
        except FileNotFoundError:
            raise KeyError(file_id) from None
        meta["bytes"] = self.data_path(file_id).stat().st_size
        return meta

    def files(self) -> list[dict[str, Any]]:
        found = [self.file(p.stem) for p in self.files_dir.glob("*.json")]
        return sorted(found, key=lambda f: (f["created_at"], f["id"]))

    def delete_file(self, file_id: str) -> None:
        self.file(file_id)
        self.data_path(file_id).unlink(missing_ok=True)
        self._meta_path(file_id).unlink(missing_ok=True)

    def append_lines(self, file_id: str, lines: list[dict[str, Any]]) -> None:
        """Append JSON lines and flush them to the disk before the job counts them done."""
        if not lines:
            return
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        with open(self.data_path(file_id), "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def done_line_ids(self, file_id: str) -> set[str]:
        """The `id`s of the lines in an output file, after cutting a half-written last line."""
        path = self.data_path(file_id)
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]
            with open(path, "r+b") as f:
                f.truncate(len(data))
        return {json.loads(line)["id"] for line in data.splitlines() if line.strip()}

    # -- batches --------------------------------------------------------------------------

    def _batch_path(self, batch_id: str) -> Path:
        if "/" in batch_id or batch_id.startswith("."):
            raise KeyError(batch_id)
        return self.batches_dir / f"{batch_id}.json"

    def save_batch(self, batch: dict[str, Any]) -> None:
        _write_atomic(self._batch_path(batch["id"]), batch)

    def batch(self, batch_id: str) -> dict[str, Any]:
        try:
            return json.loads(self._batch_path(batch_id).read_text())
        except FileNotFoundError:
            raise KeyError(batch_id) from None

    def batches(self) -> list[dict[str, Any]]:
        """Every batch, newest first (the order OpenAI lists them in)."""
        found = [json.loads(p.read_text()) for p in self.batches_dir.glob("*.json")]
        return sorted(found, key=lambda b: (b["created_at"], b["id"]), reverse=True)

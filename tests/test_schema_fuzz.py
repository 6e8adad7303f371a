"""Schemathesis against the real server's OpenAPI schema: generated requests, never a 5xx.

Bounded for CI (a fixed seed and a few examples per operation, ~300 requests); raise
`DOLMUS_FUZZ_EXAMPLES` for a longer run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from server_helpers import RemoteServer


def test_generated_requests_never_get_a_server_error(tmp_path) -> None:
    examples = os.environ.get("DOLMUS_FUZZ_EXAMPLES", "8")
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    with RemoteServer("--max-num-seqs", "16", log=tmp_path / "server.log") as server:
        proc = subprocess.run(
            [
                st, "run", f"{server.url}/openapi.json",
                "--checks", "not_a_server_error",
                "--max-examples", examples,
                "--seed", "1",
                "--request-timeout", "60",
                "--no-color",
            ],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,  # its cache goes there
        )  # fmt: skip
        assert server.proc.poll() is None  # still up
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout

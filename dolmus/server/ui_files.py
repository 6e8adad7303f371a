"""The chat page's static files (server/ui/), served with a strict Content-Security-Policy.

Everything the page runs ships inside the package (vendored libraries included), so the
policy can be `default-src 'self'`: no CDN, no inline script, nothing that leaves the host.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from fastapi.responses import FileResponse, Response

UI_DIR = Path(__file__).parent / "ui"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a server upgrade must not leave an old page running
}
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html", ".svg": "image/svg+xml"}


def ui_file(relative: str) -> Response:
    """The file at `relative` under the UI folder, or 404 (never anything outside it)."""
    root = UI_DIR.resolve()
    path = (root / relative).resolve()
    if not path.is_relative_to(root) or not path.is_file() or path.name.startswith("."):
        return Response("not found", status_code=404, media_type="text/plain")
    media = _TYPES.get(path.suffix) or mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return FileResponse(path, media_type=media, headers=SECURITY_HEADERS)

"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and under
Ollama's routes (/api/...) in Ollama's: `{"error": "<message>"}` (its clients read that string).

Status codes: 400 bad field or body, 401 missing/wrong API key, 404 unknown route or model,
413 body too large, 429 waiting queue full (with Retry-After), 503 model still loading
or engine stopped, 500 anything unexpected.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# where OpenAI types an error by what went wrong rather than by status: an unknown model is a
# 404 of type invalid_request_error (a request naming a model, not a missing route)
_TYPE_OF_CODE = {"model_not_found": "invalid_request_error"}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPE_OF_CODE.get(code or "") or _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


OLLAMA_PREFIX = "/api/"  # Ollama's API lives under it (server/ollama/); nothing else does


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API that `path` belongs to."""
    if path.startswith(OLLAMA_PREFIX):
        return JSONResponse({"error": exc.message}, exc.status, exc.headers)
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), exc.status, exc.headers)


def error_bytes(status: int, message: str, code: str | None = None, path: str = "") -> bytes:
    if path.startswith(OLLAMA_PREFIX):
        return json.dumps({"error": message}).encode()
    return json.dumps(error_body(status, message, code=code)).encode()


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(APIError(400, message, code="invalid_json"), path)
        return error_response(validation_error(errors), path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        error = APIError(exc.status_code, message, headers=getattr(exc, "headers", None))
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(APIError(500, f"internal error: {exc!r}"), request.url.path)


def validation_error(errors: list[Any]) -> APIError:
    """A body's pydantic validation errors as one 400 naming the first bad field (the batch
    runner words its per-line errors with this too)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = "; ".join(_describe(e) for e in errors) or "invalid request"
    return APIError(400, message, param=".".join(loc) or None, code="invalid_value")


def _describe(error: dict[str, Any]) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
    return f"{loc}: {error.get('msg', 'invalid')}" if loc else str(error.get("msg", "invalid"))

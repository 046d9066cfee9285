"""The OpenAI error shape, and the HTTP status each failure gets.

Every error body is `{"error": {"message", "type", "param", "code"}}` (what the `openai` SDK
parses into `APIStatusError`), `code` never null (`ErrorBody`, the schema of every error
status in /openapi.json). Statuses: 400 a malformed request (bad JSON, an unknown field,
an unsupported option, an unusable prompt) and a prompt over the model's window (code
`context_length_exceeded`, as OpenAI and vLLM answer: the SDK's `BadRequestError`); 401 a
missing or wrong API key; 404 an unknown model, collection or route; 422 a well-formed request
with an invalid value (names the field in `param`); 429 the queue is full (with `Retry-After`);
503 out of memory or shutting down; 504 the request timed out; 500 anything else.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from rapid_integrations.errors import (
    ContextWindowExceededError,
    DeviceOutOfMemoryError,
    RapidConfigError,
    RapidError,
    RapidInputError,
)

from .schemas import RAPID_OPTIONS

log = logging.getLogger("rapid.serve")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(BaseModel):
    """The body of every error status (OpenAI's shape)."""

    error: ErrorDetail


class ServeError(Exception):
    """A failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def unsupported(param: str, message: str) -> ServeError:
    """400 for an OpenAI option this server does not implement (or a value of it)."""
    return ServeError(400, f"{param}: {message}", param=param, code="unsupported_parameter")


def classify(exc: BaseException) -> ServeError:
    """The `ServeError` an exception raised while serving a request answers with."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, ContextWindowExceededError):
        return ServeError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, RapidConfigError):
        return ServeError(422, str(exc), param=exc.field, code="invalid_value")
    if isinstance(exc, RapidInputError) or (
        isinstance(exc, RapidError) and isinstance(exc, ValueError)
    ):
        return ServeError(400, str(exc), code="invalid_request")
    if isinstance(exc, DeviceOutOfMemoryError):
        return ServeError(503, str(exc), type="server_error", code="out_of_memory")
    if isinstance(exc, TimeoutError):
        return timed_out()
    log.error("request failed", exc_info=exc)
    return ServeError(
        500,
        f"internal error: {type(exc).__name__}: {exc}",
        type="server_error",
        code="internal_error",
    )


def timed_out() -> ServeError:
    return ServeError(504, "the request timed out", type="timeout_error", code="request_timeout")


def _validation_error(exc: RequestValidationError) -> ServeError:
    """FastAPI's body validation errors: unparsable JSON is 400, a field the body may not
    have 400 (OpenAI's `unknown_parameter`), a bad value 422."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") in ("json_invalid", "model_attributes_type") or first["loc"] == ("body",):
        detail = first.get("ctx", {}).get("error") or first.get("msg", "")
        return ServeError(
            400, f"the request body is not a JSON object: {detail}", code="invalid_json"
        )
    unknown = next((e for e in errors if e["type"] == "extra_forbidden"), None)
    if unknown is not None:
        return _unknown_field(_param(unknown, exc.body))
    param = _param(first, exc.body)
    return ServeError(422, f"{param}: {first['msg']}", param=param, code="invalid_value")


def _param(error: Mapping[str, Any], body: Any) -> str:
    """Where a validation error is, as the client wrote it (`text.format.name`): the error's
    path through the body, without the names pydantic gives a union's members (`stop.str`);
    a missing field ends the path."""
    path: list[str] = []
    node = body
    for part in error["loc"][1:]:
        inside = isinstance(node, dict) and part in node
        at = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if inside or at:
            node = node[part]
            path.append(str(part))
    if error["type"] == "missing":
        path.append(str(error["loc"][-1]))
    return ".".join(path)


def _unknown_field(param: str) -> ServeError:
    where = "" if "." in param else f" RAPID options: {', '.join(RAPID_OPTIONS)}"
    return ServeError(
        400,
        f"Unrecognized request argument supplied: {param}.{where}",
        param=param,
        code="unknown_parameter",
    )


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}
"""The `code` of the errors Starlette raises itself (an unknown route, a wrong method)."""


def install_error_handlers(app: FastAPI) -> None:
    """Answer every failure in the OpenAI error shape."""

    async def serve_error(request: Request, exc: Exception) -> JSONResponse:
        return classify(exc).response()

    async def validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        error = ServeError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return error.response()

    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
    # ServeError and RapidError are answered here; any other exception is answered the same
    # way by Starlette's outermost middleware, which then re-raises it for the server's log.
    for kind in (ServeError, RapidError, Exception):
        app.add_exception_handler(kind, serve_error)

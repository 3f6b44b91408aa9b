"""Errors the gateway answers with: each becomes a 4xx/5xx JSON body naming the field."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class HTTPError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        kind: str = "invalid_request_error",
        retry_after: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.field, self.kind = status, message, field, kind
        self.retry_after = retry_after


def error_type(status: int) -> str:
    return {400: "validation", 413: "validation", 422: "validation", 429: "overloaded", 503: "overloaded"}.get(
        status, "generation"
    )


def error_response(route: str, e: HTTPError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after:
        headers["Retry-After"] = e.retry_after
    if e.status in (408, 413):  # the rest of the body is not read: the connection cannot go on
        headers["Connection"] = "close"
    if route.startswith("/v1/"):
        body: dict = {"error": {"message": e.message, "type": e.kind, "param": e.field, "code": None}}
    else:  # TGI's shape: {"error", "error_type"}
        body = {"error": e.message, "error_type": error_type(e.status), "field": e.field}
    return JSONResponse(body, status_code=e.status, headers=headers)

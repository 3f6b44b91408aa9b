"""The gateway's edge: the API key check, per-client limits, request counts, and the error body
each API expects (OpenAI's or TGI's shape)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse

from . import tgi_api
from .http_errors import HTTPError
from .limits import retry_after

if TYPE_CHECKING:
    from .gateway import Gateway

KNOWN_ROUTES = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/generate",
    "/generate_stream",
    "/",
    "/info",
    "/health",
    "/metrics",
}


def error_response(route: str, e: HTTPError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.retry_after:
        headers["Retry-After"] = e.retry_after
    if route.startswith("/v1/"):
        body: dict = {"error": {"message": e.message, "type": e.kind, "param": e.field, "code": None}}
    else:  # TGI's shape: {"error", "error_type"}
        body = {"error": e.message, "error_type": tgi_api.error_type(e.status), "field": e.field}
    return JSONResponse(body, status_code=e.status, headers=headers)


class Guard:
    """ASGI middleware: the API key check and per-route request counts. (Pure ASGI, not Starlette's
    BaseHTTPMiddleware, which hides a client's disconnect from the handlers.)"""

    OPEN = ("/health", "/docs", "/openapi.json")

    def __init__(self, app, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        client = None
        try:
            if path not in self.OPEN:
                auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
                try:
                    key = self.gw.check_key(auth)
                    if scope["method"] == "POST":  # generation routes: limited per client
                        who = f"key:{key}" if key else f"addr:{(scope.get('client') or ('?',))[0]}"
                        wait = self.gw.limits.acquire(who)
                        if wait is not None:
                            raise HTTPError(429, f"too many requests; retry in {wait:.1f} s", None, "rate_limit_error",
                                            retry_after(wait))  # fmt: skip
                        client = who
                except HTTPError as e:
                    await error_response(path, e)(scope, receive, send_status)
                    return
            await self.app(scope, receive, send_status)
        finally:
            if client is not None:
                self.gw.limits.release(client)
            self.gw.http_requests.labels(path if path in KNOWN_ROUTES else "other", str(status)).inc()

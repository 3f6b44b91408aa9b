"""The gateway's edge: the API key check, per-client limits, request counts, and the error body
each API expects (OpenAI's or TGI's shape)."""

from __future__ import annotations

import hmac

from .core import Gateway
from .errors import HTTPError, error_response
from .limits import retry_after

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
    "/metrics/cluster",
}


def check_key(keys: list[bytes], authorization: str) -> str | None:
    """The caller's key (None when the gateway has none); every key is compared in constant time."""
    if not keys:
        return None
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    matched = None
    for key in keys:  # no early exit: the time taken says nothing about which key was close
        if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
            matched = key.decode()
    if matched is None:
        raise HTTPError(
            401, "missing or wrong API key (send Authorization: Bearer <key>)", None, "authentication_error"
        )
    return matched


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
                    key = check_key(self.gw.keys, auth)
                    scope.setdefault("state", {})["api_key"] = key  # its priority class (Gateway.prioritize)
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

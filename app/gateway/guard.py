"""The gateway's edge: the API key check (and the caller's tenant), the operator's key on the adapter
routes, a keyless gateway's browser checks, per-client limits, request counts, and the error body each
API expects (OpenAI's or TGI's shape)."""

from __future__ import annotations

import hashlib
import hmac

from weightq.tasks.limits import LOCAL_TENANT

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
    "/live",
    "/ready",
    "/docs",
    "/openapi.json",
    "/metrics",
    "/metrics/cluster",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
}


def check_key(keys: list[bytes], authorization: str, refuse: bool = True) -> str | None:
    """The caller's key (None when the gateway has none; without `refuse`, None for a wrong key too);
    every key is compared in constant time."""
    if not keys:
        return None
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode()
    matched = None
    for key in keys:  # no early exit: the time taken says nothing about which key was close
        if hmac.compare_digest(given, key) and scheme.lower() == "bearer":
            matched = key.decode()
    if matched is None and refuse:
        raise HTTPError(
            401, "missing or wrong API key (send Authorization: Bearer <key>)", None, "authentication_error"
        )
    return matched


def tenant_of(key: str | None) -> str:
    """The tenant of a caller: an id of its API key (a hash: the key itself never reaches Redis), or
    the one local tenant of a keyless gateway."""
    if key is None:
        return LOCAL_TENANT
    return "key-" + hashlib.blake2b(key.encode(), digest_size=12, person=b"weightq-tenant").hexdigest()


class Guard:
    """ASGI middleware: the API key check and per-route request counts. (Pure ASGI, not Starlette's
    BaseHTTPMiddleware, which hides a client's disconnect from the handlers.)"""

    OPEN = ("/health", "/live", "/ready")  # the probes: what a load balancer or Kubernetes calls without a key
    METRICS = ("/metrics", "/metrics/cluster")  # also open to METRICS_KEY
    OPERATOR = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # OPERATOR_KEY's, and no one else's

    def __init__(self, app, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway
        self.operator_keys = operator_keys(gateway.settings.gateway.operator_key)

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
        state = scope.setdefault("state", {})
        try:
            try:
                headers = dict(scope["headers"])
                if self.gw.browser is not None:  # keyless: what a browser page could send is refused
                    self.gw.browser.check(scope["method"], headers)
                authorization = headers.get(b"authorization", b"").decode("latin-1")
                if path in self.OPERATOR:
                    self.check_operator(authorization)
                    state["operator"] = True  # what every worker loads is the operator's act (lora_routes)
                elif (
                    path in self.METRICS
                    and self.gw.metrics_key
                    and check_key([self.gw.metrics_key], authorization, False)
                ):
                    pass  # Prometheus' own credential: the metrics, nothing else
                elif path not in self.OPEN:
                    key = check_key(self.gw.keys, authorization)
                    state["api_key"] = key  # its priority class (priority.py)
                    state["tenant"] = tenant_of(key)  # whose jobs it may start, resume and cancel
                    if scope["method"] == "POST":  # generation routes: limited per client
                        who = f"key:{key}" if key else f"addr:{(scope.get('client') or ('?',))[0]}"
                        wait = self.gw.limits.acquire(who)
                        if wait is not None:
                            raise HTTPError(429, f"too many requests; retry in {wait:.1f} s", None, "rate_limit_error",
                                            retry_after(wait))  # fmt: skip
                        client = state["limited_as"] = who
                        state["held"] = 1  # generations it holds: Gateway.hold() adds a request's other choices
            except HTTPError as e:
                await error_response(path, e)(scope, receive, send_status)
                return
            await self.app(scope, receive, send_status)
        finally:
            if client is not None:
                self.gw.limits.release(client, state.get("held", 1))
            self.gw.http_requests.labels(path if path in KNOWN_ROUTES else "other", str(status)).inc()

    def check_operator(self, authorization: str) -> None:
        """The adapter routes: the operator's key, or 403 (a tenant's API key, or none, included)."""
        if not self.operator_keys:
            raise HTTPError(403, ADAPTERS_OFF, None, "permission_error")
        if check_key(self.operator_keys, authorization, False) is None:
            raise HTTPError(403, NOT_OPERATOR, None, "permission_error")


NOT_OPERATOR = "loading and unloading LoRA adapters needs the operator's key (Authorization: Bearer <OPERATOR_KEY>)"
ADAPTERS_OFF = (
    "loading and unloading LoRA adapters at run time is off: the operator sets OPERATOR_KEY to allow it, "
    "with LORA_ROOT or LORA_HUB_IDS saying where adapters may come from"
)


def operator_keys(spec: str) -> list[bytes]:
    """OPERATOR_KEY's keys (comma: several)."""
    return [k.strip().encode() for k in spec.split(",") if k.strip()]

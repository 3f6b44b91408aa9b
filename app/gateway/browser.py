"""What a web page in the user's own browser could make a keyless gateway do, refused.

Without API_KEY nothing but the network guards the gateway, and a page the user visits can reach
127.0.0.1: a form or `fetch(..., {mode: "no-cors"})` POSTs a `text/plain` body without a CORS
preflight (cross-site request forgery), and a page whose name re-resolves to 127.0.0.1 (DNS
rebinding) reads the answers as its own. So, as Jupyter guards a local server, a keyless gateway
bound to a loopback address answers only requests whose Host names it (localhost, a loopback
address, or ALLOWED_HOSTS; bound elsewhere, with --allow-insecure, any name, as Jupyter's
allow_remote_access), and takes request bodies only as `application/json`, which no page can send
to another origin without a preflight that the gateway never grants. With keys, the key is the guard.
"""

from __future__ import annotations

import ipaddress

from .errors import HTTPError


class BrowserGuard:
    def __init__(self, bind_host: str, allowed_hosts: str) -> None:
        names = {h.strip().lower() for h in allowed_hosts.split(",") if h.strip()}
        self.any_host = "*" in names or not _loopback(bind_host.strip("[]"))
        self.names = names | {"localhost"}

    def check(self, method: str, headers: dict[bytes, bytes]) -> None:
        """Raises HTTPError for a request a browser page could have sent on its own."""
        host = headers.get(b"host")
        if host is not None and not self.any_host and not self.allows(host.decode("latin-1")):
            raise HTTPError(
                403,
                "the Host header names no address of this gateway (a keyless gateway answers only "
                "localhost, loopback addresses, its bind address and ALLOWED_HOSTS)",
                "Host",
                "permission_error",
            )
        if method == "POST":
            kind = headers.get(b"content-type", b"").decode("latin-1").split(";", 1)[0].strip().lower()
            if kind != "application/json":
                raise HTTPError(
                    415,
                    f"request bodies must be sent as application/json (got {kind[:64] or 'none'!r})",
                    "Content-Type",
                )

    def allows(self, host: str) -> bool:
        name = _hostname(host)
        return name in self.names or name.endswith(".localhost") or _loopback(name)


def _loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _hostname(host: str) -> str:
    """The name in a Host header, without its port: "[::1]:8000" -> "::1", "a.b:80" -> "a.b"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host

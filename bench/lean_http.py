"""A lean HTTP/1.1 client for load generators: one streaming POST per connection (`Connection: close`).

httpx spent about half of a bench process's CPU on 256 streams (its pool scans every connection on each
close; its line iterator decodes every chunk), on the two cores the servers under test share: the load
generator, not the stack, set the figures. This one parses what it must (the status, the headers, the
chunked framing for SSE lines) and `drain()` reads the rest of a response as raw bytes to the end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator


class Response:
    """One response: `status`, `headers` (lower-case names), then `lines()` or `body()` or `drain()`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> None:
        self.reader, self.writer = reader, writer
        first, *rest = head.decode("latin-1").split("\r\n")
        self.status = int(first.split(" ", 2)[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in rest if h)}
        self.chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"

    async def parts(self) -> AsyncIterator[bytes]:
        """The body as it comes, without its chunked framing."""
        reader = self.reader
        while True:
            if self.chunked:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return
                yield (await reader.readexactly(size + 2))[:-2]
            else:
                part = await reader.read(65536)
                if not part:
                    return
                yield part

    async def lines(self) -> AsyncIterator[tuple[float, bytes]]:
        """(arrival time, line) of the body; SSE lines end at b"\\n" only (not at U+2028 and kin)."""
        buf = b""
        async for part in self.parts():
            now = time.time()
            buf += part
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield now, line

    async def body(self) -> bytes:
        return b"".join([p async for p in self.parts()])

    async def drain(self) -> int:
        """Reads to the end (the server closes the connection after the response); the bytes read."""
        n = 0
        while part := await self.reader.read(262144):
            n += len(part)
        return n

    def close(self) -> None:
        self.writer.close()


class LeanHttp:
    def __init__(self, base: str) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)

    async def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> Response:
        """Sends the request and reads the response's head; the caller reads the body and closes it."""
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        try:
            payload = json.dumps(body).encode()
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{extra}"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            return Response(reader, writer, await reader.readuntil(b"\r\n\r\n"))
        except BaseException:
            writer.close()
            raise

    async def stream(self, path: str, body: dict) -> AsyncIterator[tuple[float, bytes]]:
        """Yields (arrival time, SSE line) after an HTTP 200; raises RuntimeError on another status."""
        r = await self.post(path, body)
        try:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.reader.read(300))!r}")
            async for item in r.lines():
                yield item
        finally:
            r.close()

"""An OpenAI streaming client for the service tests: what a browser or SDK sees, event by event."""

from __future__ import annotations

import json
import time

import httpx


def read_sse(base: str, path: str, body: dict, out: dict, headers: dict | None = None) -> None:
    """One streamed answer into `out`: its status and events as (arrival time, SSE id, data); an
    exception is kept in out["error"], so that a thread reading many streams reports each."""
    out["events"] = []
    try:
        with httpx.stream("POST", base + path, json=body, headers=headers or {}, timeout=600) as resp:
            out["status"] = resp.status_code
            event_id = None
            for line in resp.iter_lines():
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("data: {"):
                    out["events"].append((time.time(), event_id, json.loads(line[6:])))
    except Exception as e:
        out["error"] = repr(e)


def openai_text(events: list[tuple]) -> str:
    """The text of an OpenAI completions stream's events."""
    return "".join(c["choices"][0]["text"] for _, _, c in events if c.get("choices"))

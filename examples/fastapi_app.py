"""A FastAPI app that streams a weightq job to the browser as server-sent events.

    pip install weightq fastapi uvicorn && uvicorn fastapi_app:app      # then open http://127.0.0.1:8000

Tokens arrive as `data: {"text": ...}` events, then one `end` event with the result (or an `error`
event); if the browser leaves, Starlette cancels the response and the job is cancelled (Job.asse).
"""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, StreamingResponse
from weightq.client import Client
from weightq.client.sse import HEADERS

app = FastAPI()
client = Client()


@app.get("/", response_class=HTMLResponse)
def page() -> str:
    return (Path(__file__).parent / "static" / "ask.html").read_text()


@app.get("/ask")
def ask(q: str) -> StreamingResponse:
    job = client.submit(messages=[{"role": "user", "content": q}], max_new_tokens=256)
    return StreamingResponse(job.asse(timeout=120), media_type="text/event-stream", headers=HEADERS)

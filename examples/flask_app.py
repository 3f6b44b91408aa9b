"""A Flask app that streams a weightq job to the browser as server-sent events.

    pip install weightq flask && flask --app flask_app run      # then open http://127.0.0.1:5000

Tokens arrive as `data: {"text": ...}` events, then one `end` event with the result (or an `error`
event); if the browser leaves, Flask closes the response and the job is cancelled (Job.sse).
"""

from pathlib import Path

from flask import Flask, Response, request
from weightq.client import Client
from weightq.client.sse import HEADERS

app = Flask(__name__)
client = Client()


@app.get("/")
def page():
    return (Path(__file__).parent / "static" / "ask.html").read_text()


@app.get("/ask")
def ask():
    job = client.submit(messages=[{"role": "user", "content": request.args["q"]}], max_new_tokens=256)
    return Response(job.sse(timeout=120), mimetype="text/event-stream", headers=HEADERS)

"""A web app as its authors lay it out: Celery's tutorial `tasks.py` and Flask's `app.py` in the working
directory, importing our client beside them (the installed names are under `weightq`, so theirs win
nothing from ours), with no engine installed, submitting to a real worker and streaming to the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CELERY_TUTORIAL = """
from celery import Celery

app = Celery("tasks", broker="redis://localhost:6379/0")


@app.task
def add(x, y):
    return x + y
"""
FLASK_APP = """
app = object()  # Flask(__name__) in a real one
"""
WEB_APP = """
import sys

for name in ("torch", "transformers", "tokenizers", "safetensors"):
    sys.modules[name] = None  # `pip install weightq` alone: no worker extra

import app
import tasks
from weightq.client import Client

assert tasks.add.name == "tasks.add" and app.app is not None  # their modules are the ones imported
job = Client().submit("The web app asks", max_new_tokens=12, request_id="web-app-1")
text = "".join(job.stream(timeout=120))
print(json.dumps({"text": text, "result": job.result(timeout=60)}))
"""


def test_a_celery_and_flask_project_submits_and_streams_a_job(service, tmp_path):
    service.worker().wait_ready()
    (tmp_path / "tasks.py").write_text(CELERY_TUTORIAL)
    (tmp_path / "app.py").write_text(FLASK_APP)
    env = dict(os.environ, REDIS_URL=service.url)
    env.pop("PYTHONPATH", None)  # as a user's shell: the installed weightq, their directory first
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + textwrap.dedent(WEB_APP)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    done = json.loads(out.stdout.strip().splitlines()[-1])
    result = done["result"]
    assert done["text"] == result["text"] and result["id"] == "web-app-1"
    assert result["finish_reason"] in ("length", "eos") and 1 <= result["usage"]["completion_tokens"] <= 12

"""A web app as its authors lay it out: Celery's tutorial `tasks.py` and Flask's `app.py` in the working
directory, importing our client beside them (the installed names are under `weightq`, so theirs win
nothing from ours), with no engine installed, submitting to a real worker and streaming to the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.service  # real Redis servers and worker processes

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


def _readme_example(marker: str) -> str:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    return next(b for b in re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S) if marker in b)


def test_the_readmes_client_and_celery_examples_run(service, tmp_path):
    """The README's Python client example and its Celery-by-name one, as written, against a real worker."""
    service.worker().wait_ready()
    client = _readme_example("client = Client()  # REDIS_URL")
    by_name = _readme_example("app.send_task(").replace("redis://localhost:6379/0", service.url)
    env = dict(os.environ, REDIS_URL=service.url)
    out = subprocess.run(
        [sys.executable, "-c", client + "\nprint('\\n---')\n" + by_name],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    streamed, by_name_text = out.stdout.rsplit("\n---\n", 1)
    assert streamed and by_name_text.strip()  # both printed generated text

"""Every sh and Python snippet of the README runs as written, against one live stack for the module: a
Redis (tests/servers.py), a worker on `builtin:tiny` (the model the README's commands default to, small
enough to serve for real here, so the adapter snippets run on the paged runner) started the way the
README's LoRA section starts one (`LORA_MODULES` with a local `support` adapter, and `LORA_ROOT` holding
a `sales` one for the runtime load), and a gateway on a free port with an `OPERATOR_KEY`.

What is substituted: `localhost:8000` becomes the gateway's port, and `REDIS_URL` (with `OPERATOR_KEY`
and `LORA_ROOT`, which the operator's snippet reads from its shell) comes through the environment, with
`.venv/bin` on `PATH` as in an activated venv and `WEIGHTQ_HOME` in the test's own directory. Each
snippet runs in a directory of its own where `examples/` is the repository's. A block whose fence has
`<!-- not run here: why -->` on the line before is skipped (installs, docker, kubectl, GPUs, hub
downloads, stacks that run until stopped); tests/repo/test_readme.py still checks its commands parse.
A snippet passes when it exits 0 and, for curl, when it printed an answer that is not an error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from weightq.cli.processes import GatewayProcess, WorkerProcess

pytestmark = pytest.mark.service  # a real Redis, worker and gateway

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SKIP = re.compile(r"^<!-- not run here: (.+) -->$")
ERROR = re.compile(r'"error"\s*:|"object"\s*:\s*"error"')
OPERATOR_KEY = "readme-operator"
# Snippets that need features other parts of the code are still growing: marked, never hidden.


@dataclass(frozen=True)
class Snippet:
    line: int  # of its fence in README.md
    lang: str
    code: str
    skip: str | None  # why it cannot run here


def snippets() -> list[Snippet]:
    lines, out = README.read_text().splitlines(), []
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w+)$", lines[i])
        if not fence:
            i += 1
            continue
        end = lines.index("```", i + 1)
        marked = SKIP.match(lines[i - 1]) if i else None
        out.append(Snippet(i + 1, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n", marked and marked.group(1)))
        i = end + 1
    return [s for s in out if s.lang in ("sh", "python")]


def test_the_readme_has_snippets_that_run():
    runnable = [s for s in snippets() if s.skip is None]
    assert len(runnable) >= 10 and any("curl" in s.code for s in runnable) and any(s.lang == "python" for s in runnable)


@dataclass
class Stack:
    port: int
    env: dict[str, str]
    home: Path


@pytest.fixture(scope="module")
def stack(redis_url, tiny_path, tmp_path_factory):
    from tests.engine.test_lora import make_adapter

    home = tmp_path_factory.mktemp("readme")
    lora_root = home / "lora"
    make_adapter(tiny_path, lora_root / "sales", 4, 12)
    support = make_adapter(tiny_path, home / "adapters" / "support", 8, 11)
    served = dict(lora_root=lora_root, operator_key=OPERATOR_KEY)
    worker = WorkerProcess(
        redis_url, "w1@readme", home, max_batch_weight=8192, concurrency=64, engine_process="off", compile="off",
        enable_lora=1, lora_modules=f"support={support}", lora_root=lora_root,
    )  # fmt: skip
    gateway = GatewayProcess(redis_url, home, **served)
    try:
        worker.wait_ready()
        gateway.wait_ready()
        env = dict(
            os.environ, REDIS_URL=redis_url, WEIGHTQ_HOME=str(home), OPERATOR_KEY=OPERATOR_KEY,
            LORA_ROOT=str(lora_root), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        )  # fmt: skip
        yield Stack(gateway.port, env, home)
    finally:
        gateway.stop()
        try:
            worker.stop()
        finally:
            worker.kill()


def params() -> list:
    out = []
    for s in snippets():
        marks = [pytest.mark.skip(reason=s.skip)] if s.skip else []
        out.append(pytest.param(s, marks=marks, id=f"README.md:{s.line}:{s.code.splitlines()[0][:40].strip()}"))
    return out


@pytest.mark.parametrize("snippet", params())
def test_the_snippet_runs_as_written(snippet: Snippet, stack: Stack, tmp_path):
    code = re.sub(r"(localhost|127\.0\.0\.1):8000\b", rf"\g<1>:{stack.port}", snippet.code)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    argv = ["bash", "-e", "-o", "pipefail", "-c", code] if snippet.lang == "sh" else [sys.executable, "-c", code]
    out = subprocess.run(argv, cwd=tmp_path, env=stack.env, capture_output=True, text=True, timeout=420)
    shown = f"README.md:{snippet.line}\n{code}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
    assert out.returncode == 0, shown
    if "curl " in code:
        assert out.stdout.strip() and not ERROR.search(out.stdout), shown

"""batcher/ is the part people study: it must import nothing but the standard library."""

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = {"torch", "redis", "celery", "kombu", "transformers", "numpy", "engine", "tasks", "app"}
ROOT = Path(__file__).resolve().parents[1]


def test_batcher_sources_import_no_heavy_or_upstream_modules():
    offenders = []
    for path in (ROOT / "batcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_importing_batcher_loads_no_forbidden_module():
    code = (
        "import sys, batcher, batcher.sim; "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

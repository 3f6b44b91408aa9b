"""Dependencies point one way: app -> tasks -> engine -> batcher. batcher/ is pure standard library."""

import ast
import subprocess
import sys
from pathlib import Path

FORBIDDEN = {"torch", "redis", "celery", "kombu", "transformers", "numpy", "engine", "tasks", "app"}
ENGINE_FORBIDDEN = {"redis", "celery", "kombu", "tasks", "app"}
ROOT = Path(__file__).resolve().parents[1]


def imports_of(package: str, forbidden: set[str]) -> list[str]:
    offenders = []
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in forbidden]
    return offenders


def test_batcher_imports_nothing_heavy_or_upstream():
    assert imports_of("batcher", FORBIDDEN) == []


def test_engine_knows_nothing_of_redis_celery_or_the_service():
    assert imports_of("engine", ENGINE_FORBIDDEN) == []


def test_importing_batcher_loads_no_forbidden_module():
    code = (
        "import sys, batcher, batcher.sim; "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""

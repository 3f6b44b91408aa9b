"""Dependencies point one way: the worker -> engine -> batcher; app -> tasks; tasks/ imports neither
engine/ nor batcher/, so the web side (the client, the batch client, the gateway, the contract) never
loads the engine or torch. batcher/ is pure standard library.

Installed, the folders are one package: app/ is `weightq`, and tasks/, engine/ and batcher/ are
`weightq.tasks`, `weightq.engine` and `weightq.batcher` (pyproject.toml's package-dir); the engine's
dependencies are the `worker` extra. bench/ is lab code, out of the wheel: run from the repository."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {
    "app": "weightq",
    "tasks": "weightq.tasks",
    "engine": "weightq.engine",
    "batcher": "weightq.batcher",
}
HEAVY = {"torch", "redis", "celery", "kombu", "transformers", "numpy"}


def layer(module: str) -> str:
    """The repository folder (layer) an absolute module name belongs to, or its top-level name."""
    parts = module.split(".")
    if parts[0] != "weightq":
        return parts[0]
    return parts[1] if len(parts) > 1 and parts[1] in ("tasks", "engine", "batcher") else "app"


def imported(path: Path, package: str) -> list[str]:
    """Absolute names of every module `path` (in dotted `package`) imports, relative imports resolved."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.append(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.append(node.module)
    return names


def module_of(path: Path) -> tuple[str, str]:
    """(module, package) of a source file, by its installed name."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [FOLDERS[rel.parts[0]], *rel.parts[1:]]
    mod = ".".join(parts[:-1] if rel.name == "__init__" else parts)
    return mod, (mod if rel.name == "__init__" else mod.rsplit(".", 1)[0])


def imports_of(folder: str, forbidden: set[str]) -> list[str]:
    offenders = []
    for path in (ROOT / folder).rglob("*.py"):
        _mod, package = module_of(path)
        offenders += [f"{path.relative_to(ROOT)}: {n}" for n in imported(path, package) if layer(n) in forbidden]
    return offenders


FORBIDDEN = HEAVY | {"engine", "tasks", "app"}
ENGINE_FORBIDDEN = {"redis", "celery", "kombu", "tasks", "app"}


def test_no_module_imports_a_folder_by_its_repository_name():
    """`import app` or `from tasks...` would find a web app's own app.py / tasks.py first; and the
    installed packages never import bench/, which the wheel leaves out (tests and bench/ itself may)."""
    offenders = []
    for folder in [*FOLDERS, "bench", "tests"]:
        bare = {"app", "tasks", "engine", "batcher"} | ({"bench"} if folder in FOLDERS else set())
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in bare]
    assert offenders == []


def test_every_package_is_installed_under_weightq():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"weightq": "app", **{v: k for k, v in FOLDERS.items() if k != "app"}}
    found = sorted(module_of(p)[0] for folder in FOLDERS for p in (ROOT / folder).rglob("__init__.py"))
    assert sorted(cfg["packages"]) == found


def test_batcher_imports_nothing_heavy_or_upstream():
    assert imports_of("batcher", FORBIDDEN) == []


def test_engine_knows_nothing_of_redis_celery_or_the_service():
    assert imports_of("engine", ENGINE_FORBIDDEN) == []


def test_importing_batcher_loads_no_forbidden_module():
    code = (
        "import sys, weightq.batcher, weightq.batcher.sim; "
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY)!r} "
        "or m.startswith(('weightq.engine', 'weightq.tasks', 'weightq.gateway', 'weightq.worker'))); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tasks_never_import_the_app():
    assert imports_of("tasks", {"app"}) == []


def test_the_contract_imports_neither_the_engine_nor_the_batcher():
    assert imports_of("tasks", {"engine", "batcher"}) == []


WEB_SIDE = ("weightq.client", "weightq.client.batch", "weightq.gateway", "weightq.tasks")
WORKER_SIDE = ("weightq.engine", "weightq.batcher", "weightq.worker", "weightq.celery")
WORKER_EXTRA = ("torch", "transformers", "tokenizers", "safetensors")


def under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _module_graph() -> dict[str, set[str]]:
    """Every repository module -> the repository modules it may load: every import statement, also
    inside functions and under TYPE_CHECKING; a module's parent packages load first."""
    paths = {module_of(p)[0]: p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        package = module_of(path)[1]
        names = set(imported(path, package))
        for node in ast.walk(ast.parse(path.read_text())):  # `from . import x`: x may be a module
            if isinstance(node, ast.ImportFrom):
                base = (package.rsplit(".", node.level - 1)[0] if node.level > 1 else package) if node.level else ""
                module = ".".join(filter(None, (base, node.module)))
                names |= {f"{module}.{a.name}" for a in node.names}
        names |= {n.rsplit(".", i)[0] for n in set(names) for i in range(1, n.count(".") + 1)}
        graph[mod] = {n for n in names if n in paths} - {mod}
    return graph


def test_the_web_side_never_imports_the_engine():
    """What the client, the batch client, the gateway and the contract can reach, by any import."""
    graph = _module_graph()
    seen: dict[str, str] = {}  # module -> the module that imports it
    todo = [m for m in graph if under(m, WEB_SIDE)]
    seen.update({m: "" for m in todo})
    while todo:
        mod = todo.pop()
        for dep in graph[mod] - set(seen):
            seen[dep] = mod
            todo.append(dep)
    assert [f"{m} (imported by {seen[m]})" for m in sorted(seen) if under(m, WORKER_SIDE)] == []


def test_a_web_app_imports_the_client_and_builds_the_gateway_without_the_engine():
    """With the worker extra's packages unimportable (as after `pip install weightq`), and none of the
    worker's modules loaded afterwards."""
    code = f"""
import sys
for name in {(*WORKER_EXTRA, "xgrammar")!r}:
    sys.modules[name] = None  # `import torch` now fails as if it were not installed
from weightq.client import Client, submit
from weightq.client.batch import run_batch
from weightq.gateway import create_app
from weightq.settings import Settings
Client("redis://127.0.0.1:9/0").app  # the client's Celery app: built, not connected
create_app(Settings(redis_url="redis://127.0.0.1:9/0"))
heavy = {(*WORKER_EXTRA, *WORKER_SIDE)!r}
loaded = [m for m in sys.modules if sys.modules[m] and any(m == h or m.startswith(h + ".") for h in heavy)]
print(",".join(sorted(loaded)))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == ""


def test_the_engine_dependencies_are_the_worker_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(specs: list[str]) -> set[str]:
        return {re.split(r"[\[<>=!;~ ]", spec, maxsplit=1)[0] for spec in specs}

    assert not names(project["dependencies"]) & set(WORKER_EXTRA)  # `pip install weightq`: a web app
    assert names(project["optional-dependencies"]["worker"]) == set(WORKER_EXTRA)
    from weightq.cli.stack import WORKER_EXTRA as checked_by_the_cli

    assert set(checked_by_the_cli) == set(WORKER_EXTRA)
    assert '-e ".[dev,worker]"' in (ROOT / "Makefile").read_text()  # `make run` / `make test` install all
    docker = (ROOT / "Dockerfile").read_text()  # the web image without the engine, the worker's with it
    assert '".[flower]"' in docker and '".[worker]"' in docker


def _app_imports() -> dict[str, set[str]]:
    """app module -> the app modules it imports (module level, relative or absolute; TYPE_CHECKING too)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "app").rglob("*.py"):
        mod, package = module_of(path)
        graph[mod] = {n for n in imported(path, package) if layer(n) == "app" and n.startswith("weightq")}
    # an import of a package means its __init__; of a name inside a module, that module
    modules = set(graph)
    return {m: {d if d in modules else d.rsplit(".", 1)[0] for d in ds} & modules - {m} for m, ds in graph.items()}


def test_app_has_no_import_cycles_between_its_subpackages():
    graph = _app_imports()

    def sub(m: str) -> str:
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or (ROOT / "app" / parts[-1]).is_dir() else m

    edges = {(sub(a), sub(b)) for a, ds in graph.items() for b in ds if sub(a) != sub(b)}
    for a, b in edges:
        assert (b, a) not in edges, f"weightq.{a} and weightq.{b} import each other"


def test_app_layout_a_newcomer_can_read():
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(top) <= 8, f"app/ has {len(top)} modules at its top level: {top}"
    long = []
    for path in (ROOT / "app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                long.append(f"{path.relative_to(ROOT)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []


def test_the_job_contract_is_spelled_once():
    """The task name, the Redis keys and the stream entry types live in tasks/contract.py alone."""
    spelled = re.compile(
        r"""["']weightq\.generate["']|["']weightq:[a-z]"""
        r"""|(get\(b?["']type["']\)|\[b?["']type["']\]) *(==|!=|in) *\(?b?["'](token|end|error|attempt)["']"""
        r"""|["']type["']: *["'](token|end|error|attempt)["']|\(b?["']end["'], *b?["']error["']\)"""
    )
    offenders = []
    for package in ("app", "tasks", "bench"):
        for path in (ROOT / package).rglob("*.py"):
            if path.name == "contract.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if spelled.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert offenders == []


def _product_imports() -> dict[str, set[str]]:
    """Every product module -> the product modules it imports anywhere in it (module level, in a
    function, under TYPE_CHECKING): `from . import x` is module x, `from .m import name` is m."""
    graph: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            mod, package = module_of(path)
            names: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names |= {a.name for a in node.names}
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                        base = f"{up}.{node.module}" if node.module else up
                    names |= {f"{base}.{a.name}" for a in node.names}
            graph[mod] = {n for n in names if n.startswith("weightq")}
    modules = set(graph)

    def owner(name: str) -> str:  # the module a dotted name lives in
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    return {m: {owner(d) for d in ds} & modules - {m} for m, ds in graph.items()}


def test_no_import_circle_anywhere_in_the_product():
    """Dependencies point one way inside each layer too: a circle (even through TYPE_CHECKING or an
    import in a function) is two modules that cannot be read, tested or changed apart."""
    graph = _product_imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                circles.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_batchers_parts_never_reach_the_batcher():
    """The Batcher decides and its parts answer: no module of batcher/ imports it (not even for
    typing) but the package's own __init__ and the simulator, which uses it as any caller does."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "batcher").rglob("*.py")
        if path.name not in ("__init__.py", "batcher.py")
        and "sim" not in path.relative_to(ROOT / "batcher").parts
        and any(
            n.endswith(".batcher.batcher") or n == "weightq.batcher.Batcher" for n in imported(path, module_of(path)[1])
        )
    ]
    assert offenders == []


def _chain(node: ast.AST) -> list[str]:
    """`a.b[i].c` as ["c", "b", "a"]: the attributes from the last, then the root name."""
    chain = []
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute):
            chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        chain.append(node.id)
    return chain


def test_nothing_outside_the_batcher_changes_its_state():
    """Outside batcher/, the batcher is asked and told through its methods: no assignment reaches
    into it or its parts (`engine.batcher.budget = ...`; `slots = batcher.adapters` then
    `slots.slot_weight = ...`; `b.committed = 0` for a `b: Batcher`)."""
    offenders = []
    for folder in ("app", "tasks", "engine", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text())
            held = {"batcher"}  # names that hold the batcher or one of its parts
            for node in ast.walk(tree):
                if isinstance(node, ast.arg) and "Batcher" in ast.unparse(node.annotation or ast.Constant("")):
                    held.add(node.arg)
                one = isinstance(node, ast.Assign) and len(node.targets) == 1
                if one and isinstance(node.targets[0], ast.Name) and "batcher" in _chain(node.value):
                    held.add(node.targets[0].id)
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                for target in targets:
                    if not isinstance(target, ast.Attribute | ast.Subscript):
                        continue
                    chain = _chain(target)
                    if "batcher" in chain[1:-1] or (chain and chain[-1] in held):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(target)}")
    assert offenders == []


def test_engine_and_batcher_classes_are_not_built_from_mixins():
    """A class built on two or more of our own classes is one object spread over files: its state
    lives in one place, and its methods beside it."""
    paths = sorted(p for folder in ("engine", "batcher") for p in (ROOT / folder).rglob("*.py"))
    trees = {p: ast.parse(p.read_text()) for p in paths}
    ours = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    mixed = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                local = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in ours]
                if len(local) > 1:
                    mixed.append(f"{path.relative_to(ROOT)}: {node.name} is built from mixins {local}")
    assert mixed == []


# Files a comment may name that are not ours: formats and a web app's own modules.
NOT_OURS = {"adapter_config.json", "SPEC.json", "FACTS.md", "tasks.py"}
FILE_NAMED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|toml|md|yml|yaml|cfg|json|txt|conf))\b")


def test_comments_name_files_that_exist():
    """A comment or docstring that points at a file must point at one that exists: a renamed or split
    module leaves readers searching for a file that is gone otherwise."""
    import io
    import tokenize

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(tracked.split()) or {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file()}
    names = {Path(f).name for f in files}
    stale = []
    for folder in ("app", "tasks", "engine", "batcher", "bench", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
                text = tok.string
                if tok.type != tokenize.COMMENT and not (
                    tok.type == tokenize.STRING and text.lstrip("rbfuRBFU").startswith(('"""', "'''"))
                ):
                    continue
                for ref in FILE_NAMED.findall(text):
                    if ref in names or ref in NOT_OURS or any(f == ref or f.endswith("/" + ref) for f in files):
                        continue
                    stale.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {ref}")
    assert stale == []

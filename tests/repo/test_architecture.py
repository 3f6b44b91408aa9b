"""docs/ARCHITECTURE.md stays short and names only what exists: every file path and every code name it
puts in backticks is checked against the repository, so a renamed, moved or deleted module, class or
function fails here instead of leaving readers searching for it.

The rules, for each backticked token (fenced code blocks are not checked, so the document uses none):
- a path (it ends in a known file extension or "/", or starts with a top-level folder of the
  repository, as `app/worker/intake.py` or `batcher/sim/`) must exist, relative to the repository root;
  `path: name` is checked as the path and the name;
- an HTTP path (it starts with "/") is skipped; so is anything with a space that is not a call
  (`weightq worker`, `<job id>/<entry id>`): prose and commands, not names;
- a Redis key (`weightq:...`) must be spelled, up to its first "{", in tasks/contract.py;
- an ALL_CAPS name must be an environment variable of app/settings.py (`ENV`) or a name the product
  defines (a constant: `WRITE_BATCH`, `URGENT_LOOKAHEAD`);
- a code name (`Class`, `Class.attr`, `module.func`, `func(...)`, `a.b.c`; arguments dropped) must be
  defined in the product's .py files (app/, tasks/, engine/, batcher/): `Class.attr` as a member of a
  class of that name (a method, a class attribute, or a `self.attr` assigned in a method), `module.name`
  as a name defined or imported at the top of a module with that file name, or a module of a package
  with that folder name (so an instance attribute is cited through its class: `StepOutputs.defer`,
  not `outputs.defer`); anything else part by part, each a def, a class, an assignment target, a
  parameter or a module. An all-lowercase token may also be a string value the product uses
  (`queued`, `weightq.generate`).
"""

from __future__ import annotations

import ast
import builtins
import keyword
import re
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PRODUCT = ("app", "tasks", "engine", "batcher")
MAX_LINES = 500
FILE_EXTENSIONS = (".py", ".lua", ".toml", ".yml", ".yaml", ".md", ".sh", ".txt", ".cpp", ".json")
# What the document may put in backticks that is neither a path nor a name of ours: Redis commands and
# signals, named as their manuals name them.
NOT_CODE = {"BRPOP", "XREAD", "XADD", "XRANGE", "ZPOPMIN", "PUBLISH", "SIGTERM", "SIGKILL"}
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
CALL = re.compile(r"^([A-Za-z_][\w.]*)\(.*\)$")
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")
CITED = re.compile(r"^([\w./-]+):\s+(\S.*)$")  # `engine/loop/outputs.py: replay`


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def backticked(text: str) -> list[str]:
    """Every `inline code` token outside fenced blocks; `path: name` counts as the path and the name."""
    outside = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    tokens = []
    for token in (t.strip() for t in re.findall(r"`([^`\n]+)`", outside)):
        cited = CITED.match(token)
        tokens += [cited.group(1), cited.group(2)] if cited and is_path(cited.group(1)) else [token]
    return tokens


def top_folders() -> set[str]:
    return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def is_path(token: str) -> bool:
    if token.startswith("/") or " " in token:
        return False
    if token.endswith(FILE_EXTENSIONS) and re.fullmatch(r"[\w./-]+", token):
        return "/" in token or "." in token.rsplit("/", 1)[-1]
    if "/" not in token or re.fullmatch(r"[\w./-]+", token) is None:
        return False
    return token.endswith("/") or token.split("/")[0] in top_folders()


class Names:
    """What the product's .py files define: every name, each class's members, each module's top level."""

    def __init__(self) -> None:
        self.defined: set[str] = {"weightq"}  # the installed package's own name
        self.members: dict[str, set[str]] = defaultdict(set)  # class name -> members (every class of that name)
        self.bases: dict[str, set[str]] = defaultdict(set)  # class name -> base class names
        self.modules: dict[str, set[str]] = defaultdict(set)  # module file stem -> its top-level names
        self.strings: set[str] = set()  # string constants: values the product uses
        for folder in PRODUCT:
            for path in (ROOT / folder).rglob("*.py"):
                self.defined |= {path.stem, *(p.name for p in path.relative_to(ROOT).parents if p.name)}
                parts = [p for p in path.relative_to(ROOT).with_suffix("").parts if p != "__init__"]
                for package, child in pairwise(parts):  # a package's modules and subpackages
                    self.modules[package].add(child)
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                except SyntaxError:  # a file mid-edit by someone else: its names are read next time
                    continue
                self._module(path, tree)

    def _module(self, path: Path, tree: ast.Module) -> None:
        top = self.modules[path.stem if path.stem != "__init__" else path.parent.name]
        for node in tree.body:
            top |= _bound(node)
        for node in ast.walk(tree):
            self.defined |= _bound(node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                params = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
                self.defined |= {a.arg for a in params if a is not None}
            elif isinstance(node, ast.ClassDef):
                self.members[node.name] |= _class_members(node)
                self.bases[node.name] |= {_base_name(b) for b in node.bases}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 80:
                self.strings.add(node.value)

    def has_member(self, cls: str, name: str, seen: frozenset[str] = frozenset()) -> bool:
        """`name` is a member of a class called `cls` or of one of its bases; a base outside the
        product (kombu's, Celery's) makes any name the product defines acceptable."""
        if name in self.members[cls]:
            return True
        bases = self.bases[cls] - seen
        if any(self.has_member(b, name, seen | {cls}) for b in bases if b in self.members):
            return True
        return any(b not in self.members for b in bases) and name in self.defined


def _bound(node: ast.AST) -> set[str]:
    """The names a statement binds: a def, a class, an assignment's targets, an import's names."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names = set()
    for target in targets:
        for t in ast.walk(target):
            if isinstance(t, ast.Name):
                names.add(t.id)
            elif isinstance(t, ast.Attribute):
                names.add(t.attr)
    return names


def _class_members(cls: ast.ClassDef) -> set[str]:
    members = set()
    for node in cls.body:
        members |= _bound(node)
    for node in ast.walk(cls):  # self.x = ... in its methods
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        members.add(t.attr)
    return members


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript):
        return _base_name(node.value)
    return node.id if isinstance(node, ast.Name) else ""


def env_names() -> set[str]:
    from weightq.settings import ENV

    return set(ENV)


def code_name(token: str) -> str | None:
    """The dotted name a token cites (`Class.method()`, `func(a, b)` -> its name), or None: not a name."""
    if m := CALL.match(token):
        token = m.group(1)
    return token if DOTTED.match(token) else None


def unknown_name(token: str, names: Names, env: set[str]) -> str | None:
    """Why `token` is not a name the product has, or None when it is one (or is not a name at all)."""
    if token in NOT_CODE:
        return None
    if token.startswith("weightq:"):
        contract = (ROOT / "tasks" / "contract.py").read_text(encoding="utf-8")
        return None if token.split("{")[0] in contract else "a Redis key tasks/contract.py does not spell"
    name = code_name(token)
    if name is None:
        return None
    if CAPS.match(name):
        return None if name in env or name in names.defined else "neither a setting nor a defined name"
    if name.islower() and name in names.strings:
        return None  # a value the product uses (a job state, a mode, the task's name)
    if keyword.iskeyword(name) or hasattr(builtins, name):
        return None
    parts = name.split(".")
    if len(parts) == 2:
        head, attr = parts
        if head in names.members:
            return None if names.has_member(head, attr) else f"{head} has no member {attr}"
        if head in names.modules:
            return None if attr in names.modules[head] else f"module {head} defines no {attr}"
    missing = [p for p in parts if p not in names.defined]
    return f"not defined: {', '.join(missing)}" if missing else None


def test_the_document_is_at_most_500_lines():
    lines = doc_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/ARCHITECTURE.md has {len(lines)} lines (at most {MAX_LINES})"


def test_it_opens_with_the_path_of_one_chat_request():
    text = doc_text()
    first = re.search(r"^## .*$", text, flags=re.M)
    assert first is not None and "request" in first.group(0).lower(), "the first section maps one request's path"
    assert "`/v1/chat/completions`" in text[first.end() : first.end() + 3000]


def test_every_path_it_names_exists():
    missing = sorted({t for t in backticked(doc_text()) if is_path(t) and not (ROOT / t).exists()})
    assert missing == []


def test_every_code_name_it_names_exists():
    names, env = Names(), env_names()
    wrong = {}
    for token in backticked(doc_text()):
        if is_path(token) or token.startswith("/"):
            continue
        if (why := unknown_name(token, names, env)) is not None:
            wrong[token] = why
    assert wrong == {}


def test_the_checks_catch_a_misspelt_or_deleted_name():
    """The rules above are not vacuous: names that do not exist fail, and ones that do pass."""
    names, env = Names(), env_names()
    for bad in ("Batcher._admitt", "Engine.sumbit", "JobRunner.run_job", "openai_api.chat_job_list", "Nonesuch",
                "parse_requests()", "ScheduleRunner.step", "weightq:jobs:{id}", "MAX_BATCH_WEIGHTS"):  # fmt: skip
        assert unknown_name(bad, names, env) is not None, bad
    for good in ("Batcher._admit", "Engine.submit", "JobRunner.run", "openai_api.chat_jobs", "StreamHub",
                 "parse_request(json, door)", "weightq:job:{id}", "MAX_BATCH_WEIGHT", "WRITE_BATCH"):  # fmt: skip
        assert unknown_name(good, names, env) is None, good
    assert is_path("app/worker/intake.py") and is_path("batcher/sim/") and is_path("pyproject.toml")
    assert is_path("worker/") and not (ROOT / "worker/").exists()  # a folder named from elsewhere than the root
    cited = backticked("`batcher/paging.py: Paging._window_hit` and `x`")
    assert cited == ["batcher/paging.py", "Paging._window_hit", "x"]
    assert unknown_name("Paging._window_hits", names, env) is not None
    assert unknown_name("tasks.generate", names, env) is None  # a package's module
    assert not is_path("/v1/chat/completions") and not is_path("text/event-stream")

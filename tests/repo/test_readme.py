"""The README against the code: its first screen says what weightq is, its settings tables are the
Settings class (names and defaults), its table of defaults per door is the contract's, every command it
shows exists and parses (weightq's own with the real CLI), every Python example compiles and imports
what it names, and every link to a file names one that exists. It stays a page a user reads (at most
MAX_LINES lines) that says what is true today: run history lives in git and bench/results/, not in the
README or docs/. (tests/repo/test_readme_snippets.py runs its snippets against a live stack.)"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from weightq.cli import build_parser
from weightq.gateway.guard import KNOWN_ROUTES
from weightq.settings import ENV, GROUPS
from weightq.tasks.limits import DEFAULTS, Door

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
NOT_INSTALLED_HERE = {"flask", "django"}  # the web frameworks of the examples; the client is what is tested
MAX_LINES = 500
HISTORY = re.compile(r"the run before|previous session|last session", re.I)


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def table(text: str) -> list[list[str]]:
    """The body rows of every table in `text` (a header row is the one above a `|---` line)."""
    lines = text.splitlines()
    rows = [
        line.strip("|").split(" | ")
        for i, line in enumerate(lines)
        if line.startswith("| ") and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))
    ]
    return [[cell.strip() for cell in row] for row in rows]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def commands() -> list[str]:
    """Each command of the shell blocks (continuations joined), and inline `weightq ...` spans."""
    out = []
    for block in blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    out += [span for span in re.findall(r"`([^`\n]+)`", README) if re.match(r"(\w+=\S+ )*weightq \w", span)]
    return out


def test_the_first_screen_says_what_weightq_is():
    first = " ".join(README.splitlines()[:8])
    for words in ("LLM text generation", "Celery and Redis", "GPU workers", "It is not", "one model per queue"):
        assert words in first, words


def test_the_readme_is_a_page_not_a_notebook():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES}): move depth to docs/"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not HISTORY.search(line), f"{path.name}:{n} carries run history (git keeps it): {line[:80]}"


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    titles = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}


def test_every_link_names_a_file_and_a_heading_that_exist():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", path.read_text()):
            if re.match(r"\w+://", target):
                continue
            linked = path.parent / target if target else path
            assert linked.exists(), f"{path.name} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{path.name} links to {target}#{anchor}: no such heading"


def render(default: object) -> str:
    if default == "":
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return str(default).replace(str(Path.home()), "~")


def test_the_settings_table_is_the_settings_class():
    rows = {row[0].strip("`"): row[1].strip("`") for row in table(section("Settings"))}
    fields = {env: GROUPS[group].model_fields[name].default for env, (group, name) in ENV.items()}
    assert set(rows) == set(fields), (set(fields) - set(rows), set(rows) - set(fields))
    for name, default in fields.items():
        assert rows[name] == render(default), name


def test_the_defaults_table_is_the_contracts():
    rows = {row[0].strip("`"): row for row in table(section("From a web app")) if row[0].strip("`") in set(Door)}
    assert set(rows) == set(Door)
    for door, d in DEFAULTS.items():
        _, _, max_new, temperature, _ = rows[door]
        assert max_new == ("to the context limit" if d.max_new_tokens is None else str(d.max_new_tokens)), door
        assert float(temperature) == d.temperature, door


def _check(argv: list[str]) -> None:
    tool, args = argv[0].removeprefix(".venv/bin/"), argv[1:]
    if tool == "weightq" and len(args) == 1:  # a command named in prose: `weightq batch` needs ...
        commands = next(a for a in build_parser()._actions if a.dest == "command").choices
        assert args[0] in commands, args
    elif tool == "weightq":
        build_parser().parse_args(args)  # SystemExit (a failure) for an unknown command or flag
    elif tool == "celery":
        assert args[:2] == ["-A", "weightq"] and args[2] in ("worker", "flower")
        importlib.import_module("weightq.celery")
    elif tool == "python":
        assert args[0] == "-m"
        spec = importlib.util.find_spec(args[1])
        assert spec is not None and spec.origin, args[1]
        source = Path(spec.origin).read_text()
        for flag in (a.split("=")[0] for a in args[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, (args[1], flag)
    elif tool == "make":
        assert re.search(rf"^{args[0]}:", (ROOT / "Makefile").read_text(), re.M)
    elif tool == "curl":
        assert re.sub(r"^localhost:\d+", "", args[0]) in KNOWN_ROUTES
    elif tool == "pip":
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in args[1:]:
            name, _, extra = spec.partition("[")
            assert name == "weightq" and (not extra or extra.rstrip("]") in extras), spec
    elif tool == "docker":
        if args[0] == "compose":
            assert (ROOT / "docker-compose.yml").exists()
            if "--profile" in args:
                assert f"profiles: [{args[args.index('--profile') + 1]}]" in (ROOT / "docker-compose.yml").read_text()
        else:
            assert (
                args[0] == "build" and f"AS {args[args.index('--target') + 1]}\n" in (ROOT / "Dockerfile").read_text()
            )
    elif tool == "bash":
        assert (ROOT / args[0]).is_file()
    elif tool == "kubectl":
        if args[:2] == ["apply", "-k"]:
            assert (ROOT / args[2] / "kustomization.yaml").is_file()
        else:  # the namespace the kustomization names; a secret the manifests read, with keys they read
            kustomization = (ROOT / "deploy/k8s/kustomization.yaml").read_text()
            namespace = re.search(r"^namespace: (\S+)", kustomization, re.M).group(1)
            if args[:2] == ["create", "namespace"]:
                assert args[2:] == [namespace], args
            else:
                assert args[:5] == ["-n", namespace, "create", "secret", "generic"], args
                manifests = "".join(p.read_text() for p in (ROOT / "deploy/k8s").glob("*.yaml"))
                assert re.search(rf"\b(name|secretName): {re.escape(args[5])}\b", manifests), args[5]
                for a in args[6:]:
                    key = a.removeprefix("--from-literal=").split("=")[0]
                    assert key in ("API_KEY", "METRICS_KEY") or re.search(rf"\bkey: {key}\b", manifests), key
    elif tool == "$EDITOR":
        assert (ROOT / args[0]).is_file()
    else:
        raise AssertionError(f"a README command this test does not know: {argv}")


@pytest.mark.parametrize("command", commands())
def test_every_readme_command_exists(command):
    argv = shlex.split(command, comments=True)
    while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value before the command
        argv.pop(0)
    if ">" in argv:
        argv = argv[: argv.index(">")]
    _check(argv)


def test_the_readme_shows_commands_and_examples():
    assert len(commands()) > 30 and len(blocks("python")) >= 5  # the extraction finds what is there


@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.split("\n", 1)[0][:50])
def test_every_python_example_compiles_and_imports_what_it_names(code):
    tree = compile(code, "README.md", "exec", flags=0x400)  # ast.PyCF_ONLY_AST
    for node in tree.body:
        if type(node).__name__ != "ImportFrom":
            continue
        top = node.module.split(".")[0]
        if top in NOT_INSTALLED_HERE and importlib.util.find_spec(top) is None:
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            assert hasattr(module, alias.name), (node.module, alias.name)

"""What compiling a grammar spec needs, shared by the engine's grammar thread (grammar.py) and the trial
process that compiles each new spec first (grammar_trial.py): xgrammar, imported on demand, and its
compile of one spec."""

from __future__ import annotations

from typing import Any

from ..params import InvalidRequest


class GrammarError(ValueError):
    """A spec that cannot be compiled (the message says why)."""


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    """xgrammar's compile of one spec (kind json_schema, json_object or regex); GrammarError if not."""
    try:
        if kind == "json_schema":
            return compiler.compile_json_schema(spec, any_whitespace=False)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        message = str(e).split("\n")[0]
        raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {message[:300]}") from None
    raise GrammarError(f"unknown kind {kind!r}")  # the contract admits none


def available() -> bool:
    try:
        xgrammar()
    except InvalidRequest:
        return False
    return True


def xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest(
            "guided",
            "structured output needs xgrammar on the worker: "
            "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2",
        ) from None
    return xgrammar

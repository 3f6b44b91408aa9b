"""CPU seconds of the processes under test, by role: what a server spends per streamed token.

A role is a process and, apart, its descendants (the worker's engine process, vLLM's engine core),
each descendant under its own process name, so that "outside the engine" can be told from the engine.
Only processes alive at both reads count: the servers here live through the whole run."""

from __future__ import annotations

import contextlib

import psutil


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def snapshot(roles: dict[str, int]) -> dict[tuple[str, int], tuple[str, float]]:
    """(role, pid) -> (label, CPU seconds so far) for each role's process ("<role>") and each of its
    descendants ("<role>/<process name>")."""
    out: dict[tuple[str, int], tuple[str, float]] = {}
    for role, pid in roles.items():
        try:
            root = psutil.Process(pid)
            procs = [(role, root)] + [(f"{role}/{p.name()}", p) for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for label, proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                out[role, proc.pid] = (label, _cpu(proc))
    return out


def per_1000_tokens(before: dict, after: dict, tokens: int) -> dict[str, float]:
    """ms of CPU per 1,000 tokens by label (processes of one label summed)."""
    out: dict[str, float] = {}
    for key, (label, t1) in after.items():
        if key in before:
            out[label] = out.get(label, 0.0) + 1e6 * (t1 - before[key][1]) / max(tokens, 1)
    return {k: round(v, 2) for k, v in sorted(out.items())}


def machine() -> tuple[float, float]:
    """(busy, total) CPU seconds of every core so far: `machine_busy(before, after)` is the share of
    the machine's cores in use between two reads (1.0: every core busy, whatever ran there)."""
    t = psutil.cpu_times()
    total = sum(t)
    return total - t.idle - getattr(t, "iowait", 0.0), total


def machine_busy(before: tuple[float, float], after: tuple[float, float]) -> float:
    return round((after[0] - before[0]) / max(after[1] - before[1], 1e-9), 3)

"""What a supervising command needs: stop on the signals a service manager sends, shut down without
being cut short, and refuse a port that is taken before starting anything."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1  # prctl(2)


def dies_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that asks the kernel to SIGTERM the child when the supervisor dies, however it
    dies: the children run in sessions of their own (so Ctrl-C reaches only the supervisor), and a
    SIGKILLed supervisor would otherwise leave them serving, holding its ports. SIGTERM is their warm
    shutdown. Linux only (None elsewhere: the children then outlive a killed supervisor)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the supervisor died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP (systemd, container runtimes, `timeout`, a closed terminal) stop the stack as
    Ctrl-C does: as a KeyboardInterrupt in the main thread. SIGINT too, explicitly: a process started
    in the background by a non-interactive shell inherits SIGINT ignored, and Python then installs no
    handler of its own (such a process would ignore `kill -INT`)."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def signals_ignored() -> Iterator[None]:
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOP_SIGNALS)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def port_taken(host: str, port: int) -> bool:
    """Would binding host:port fail? (Checked before anything starts, so a second `weightq up` never
    says ready on the strength of the first one's gateway.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def refuse_taken_ports(command: str, host: str, ports: dict[str, int]) -> None:
    for what, port in ports.items():
        if port and port_taken(host, port):
            raise SystemExit(
                f"{command}: {host}:{port} ({what}) is already in use, by another weightq up or gateway? "
                "Stop it, or choose another port"
            )

"""What a supervising command needs: stop on the signals a service manager sends, shut down without
being cut short, and refuse a port that is taken before starting anything."""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


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

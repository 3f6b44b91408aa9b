"""The `weightq` command line and the local stack it starts (embedded Redis, worker, gateway)."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]

"""Runners: one step's work in, logits out. base.py holds the protocol the loop needs; paged.py (the
paged runner), padded.py and simulated.py implement it; kv_cache.py lays out the paged KV pool."""

from .base import PagedMemory, Runner, Work
from .kv_cache import AttentionKind, KVCache, KVGeometry, KVLayout

__all__ = ["AttentionKind", "KVCache", "KVGeometry", "KVLayout", "PagedMemory", "Runner", "Work"]

"""Keeping the garbage collector's full passes off a long-running process's start-up heap."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (imported modules, the model, tokenizer tables: millions of
    objects) into the permanent generation, so that later full collections scan only what serving
    creates. Call it once a process is ready to serve. In a worker's process (libraries loaded, the
    engine in a child) a full collection of that heap is long and stops every thread meanwhile,
    Celery's consumer included, so the jobs taken in that moment wait to start. vLLM's engine core and
    API server freeze their heaps the same way after start-up."""
    gc.collect()
    gc.freeze()

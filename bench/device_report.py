"""The device check's sizes (on a GPU, and the --dry-run shapes) and its report: one JSON object,
rewritten after every phase (bench/device_check.py)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .device_models import MID, TINY, TINYLLAMA


@dataclass(frozen=True, slots=True)
class Sizes:
    eq_shape: dict
    eq_requests: int
    eq_max_prompt: int
    eq_max_new: int
    eq_budget: int  # KV tokens: tight enough that requests queue and prompts are chunked
    eq_prefill: int
    tp_shape: dict
    tp_dtype: str
    tp_requests: int
    tp_prompt: tuple[int, int]
    tp_new: tuple[int, int]
    tp_check: int  # requests of the throughput run compared with generate()
    static_batch: int


ON_GPU = Sizes(MID, 32, 512, 160, 4096, 256, TINYLLAMA, "bfloat16", 128, (16, 512), (16, 256), 8, 16)
DRY = Sizes(TINY, 6, 48, 16, 256, 32, TINY, "float32", 8, (8, 48), (4, 16), 8, 4)


class Report:
    """The JSON object, rewritten to --out after every phase so that a run cut off keeps its results."""

    def __init__(self, out: Path | None) -> None:
        self.t0 = time.monotonic()
        self.out = out
        self.data: dict = {"complete": False, "errors": [], "phases_s": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def error(self, where: str, e: BaseException | str) -> None:
        text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
        self.data["errors"].append(f"{where}: {text}"[:2000])

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 1)
        if self.out is not None:
            tmp = self.out.with_name(self.out.name + ".tmp")
            tmp.write_text(self.dumps(indent=2) + "\n")
            tmp.replace(self.out)

    def dumps(self, indent: int | None = None) -> str:
        for _ in range(5):  # a phase abandoned on timeout may still be adding to it
            try:
                return json.dumps(self.data, indent=indent)
            except RuntimeError:
                time.sleep(0.05)
        return json.dumps(self.data, indent=indent)


def say(report: Report, msg: str) -> None:
    print(f"[device_check {report.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)

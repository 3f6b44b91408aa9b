"""The engine's counters and rates (Meter)."""

from __future__ import annotations

import time


class Meter:
    """Steps, tokens and seconds since the engine started (or its warm-up ended), the tokens/s of
    the last second or so, and the wall time it held requests (device busy = forward_s / occupied_s)."""

    def __init__(self) -> None:
        self.counters = {
            "steps": 0,
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "finished": 0,
            "forward_s": 0.0,
            "step_s": 0.0,
            "overflow_steps": 0,  # steps whose batch held more KV tokens than the budget (must stay 0)
        }
        self._rate = {"t": time.monotonic(), "prefill": 0, "decode": 0, "prefill_tok_s": 0.0, "decode_tok_s": 0.0}
        # the mean time from one step to the next over the last second or so: the step and the loop's
        # own time around it (a projected wait counts in these: backlog.py), not an idle gap
        self._steps = {"n": 0, "s": 0.0, "step_s": 0.0, "last": 0.0}
        self._occupied_s = 0.0
        self._occupied_since: float | None = None

    def reset(self) -> None:
        for key, value in self.counters.items():
            self.counters[key] = type(value)()

    def occupancy(self, busy: bool, now: float) -> None:
        """Open the occupied span when requests arrive, close it when the last one leaves."""
        if busy and self._occupied_since is None:
            self._occupied_since = now
        elif not busy and self._occupied_since is not None:
            self._occupied_s += now - self._occupied_since
            self._occupied_since = None

    def occupied_s(self) -> float:
        since = self._occupied_since
        return self._occupied_s + (time.perf_counter() - since if since is not None else 0.0)

    def count(self, prefill: int, decode: int, forward_s: float, step_s: float) -> None:
        c = self.counters
        c["steps"] += 1
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        c["forward_s"] += forward_s
        c["step_s"] += step_s
        st = self._steps
        now = time.monotonic()
        gap = now - st["last"] if st["last"] else step_s
        st["n"], st["last"] = st["n"] + 1, now
        st["s"] += gap if gap <= 4 * step_s + 0.01 else step_s
        r = self._rate
        r["prefill"] += prefill
        r["decode"] += decode
        if now - r["t"] >= 1.0:  # rates over the last second or so
            span = now - r["t"]
            r["prefill_tok_s"], r["decode_tok_s"] = r["prefill"] / span, r["decode"] / span
            r["t"], r["prefill"], r["decode"] = now, 0, 0
            st["step_s"], st["n"], st["s"] = st["s"] / st["n"], 0, 0.0

    def rates(self) -> dict:
        return {
            "prefill_tok_s": round(self._rate["prefill_tok_s"], 1),
            "decode_tok_s": round(self._rate["decode_tok_s"], 1),
            "recent_step_s": round(self._steps["step_s"], 5),  # recent seconds per step (kept while idle)
        }

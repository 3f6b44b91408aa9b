"""Cost of the admission call with 256 running and 1,024 waiting requests.

    python -m bench.admission --json

fast_path_us:     one admission decision accepted by the naive sum (no projection).
projection_us:    one decision that needs the projection, the profile rebuilt first (as after any
                  change of the running set).
projection_cached_us: the same decision with the profile already built.
idle_step_us:     schedule() on a step with nothing new to decide (the idle shortcut).
full_pass_us:     schedule() after a change, scanning all 1,024 waiting requests and admitting none.
All are medians in microseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from batcher import Batcher, BatcherConfig, Request

RUNNING, WAITING = 256, 1024


def build(block_size: int, seed: int = 0) -> tuple[Batcher, random.Random]:
    rng = random.Random(seed)
    b = Batcher(
        BatcherConfig(
            max_batch_weight=256 * 1024, max_total_tokens=2048, block_size=block_size, jump_window_s=1e9, max_wait_s=1e9
        )
    )
    for i in range(RUNNING):
        b.submit(Request(f"run{i}", rng.randint(16, 512), rng.randint(256, 1024), arrival_s=0.0))
    while b.waiting:
        plan = b.schedule(0.0)
        b.complete(plan)
    for _ in range(rng.randint(50, 100)):  # spread the running requests' progress
        b.complete(b.schedule(0.0))
    b.budget = b.projected_peak() + 100  # a full batch: only small requests could still join
    for i in range(WAITING):  # candidates that cannot fit: admission scans and refuses them
        b.submit(Request(f"wait{i}", 2000, 48, arrival_s=1.0))
    return b, rng


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return round(statistics.median(samples) / 1000, 2)


def measure(block_size: int, repeats: int) -> dict:
    b, _ = build(block_size)
    small = Request("small", 8, 8)
    small.reserved_new = 8
    committed = b._committed
    b._committed = 0  # pretend the batch is nearly empty: the naive sum fits
    fast = median_us(lambda: b.fits(small), repeats)
    b._committed = committed
    assert not b._naive_fits(small.reserved_total)
    mid = Request("mid", 64, 256)
    mid.reserved_new = 256

    def rebuilt():
        b._profile = None
        b.fits(mid)

    projection = median_us(rebuilt, repeats)
    cached = median_us(lambda: b.fits(mid), repeats)
    b.schedule(2.0)  # a real pass: nothing fits, marks the batcher idle
    idle = median_us(lambda: b.schedule(2.0), repeats)

    def full_pass():
        b._idle = False
        b.schedule(2.0)

    full = median_us(full_pass, max(10, repeats // 10))
    return {
        "block_size": block_size,
        "fast_path_us": fast,
        "projection_us": projection,
        "projection_cached_us": cached,
        "idle_step_us": idle,
        "full_pass_us": full,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    out = {"running": RUNNING, "waiting": WAITING, **measure(args.block_size, args.repeats)}
    out["block_size_1"] = {k: v for k, v in measure(1, args.repeats).items() if k != "block_size"}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

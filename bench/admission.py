"""Cost of the admission call with 256 running and 1,024 waiting requests (and 1,024 running, 4,096 waiting).

    python -m bench.admission --json

fast_path_us:     one admission decision accepted by the naive sum (no projection).
projection_us:    one decision that needs the projection, right after the running set changed: a random
                  running request finishes (or, every other time, is put back), then the decision. The
                  change is timed with it, since that is when the profile is brought up to date (in place).
projection_cached_us: the same decision with nothing changed since the last one.
idle_step_us:     schedule() on a step with nothing new to decide (the idle shortcut).
full_pass_us:     schedule() after a change, scanning the waiting requests (up to jump_scan past the first
                  blocked one) and admitting none.
All are medians in microseconds. The top level is block size 16 with 256 running; `block_size_1` is
the same with block size 1, `window_groups` the same with a Gemma-3-shaped model's attention kinds
(5 window layers of 512 positions per full layer: batcher/weight.py), and `running_1024` all again
with 1,024 running.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from weightq.batcher import Batcher, BatcherConfig, Request
from weightq.batcher.admission import naive_fits
from weightq.batcher.request import DECODING, PREFILLING

RUNNING, WAITING = 256, 1024


# Gemma 3's layout: one page per block for the full layer, 5 for the window layers, a ring of
# ceil(511 / 16) + 1 = 33 blocks (engine/runner/kv_cache.py).
GEMMA3_KINDS = ((1, 0), (5, 33))


def build(
    block_size: int, running: int = RUNNING, seed: int = 0, kinds: tuple = ((1, 0),)
) -> tuple[Batcher, random.Random]:
    rng = random.Random(seed)
    b = Batcher(
        BatcherConfig(
            max_batch_weight=running * 1024 * (6 if len(kinds) > 1 else 1),
            max_total_tokens=2048,
            block_size=block_size,
            jump_window_s=1e9,
            max_wait_s=1e9,
            kinds=kinds,
            windows=(512,) * (len(kinds) - 1),
        )
    )
    for i in range(running):
        b.submit(Request(f"run{i}", rng.randint(16, 512), rng.randint(256, 1024), arrival_s=0.0))
    while b.waiting:
        plan = b.schedule(0.0)
        b.complete(plan)
    for _ in range(rng.randint(50, 100)):  # spread the running requests' progress
        b.complete(b.schedule(0.0))
    b.budget = b.projected_peak() + 100  # a full batch: only small requests could still join
    for i in range(running * WAITING // RUNNING):  # candidates that cannot fit: admission scans and refuses them
        b.submit(Request(f"wait{i}", 2000, 48, arrival_s=1.0))
    return b, rng


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return round(statistics.median(samples) / 1000, 2)


def put_back(b: Batcher, req: Request) -> None:
    """Admit a request that just finished again, decoding where it was: the weight accounting of
    Batcher.start and its first step (its pages left out, as before), so that the running set keeps
    its size and shape."""
    b.queue.keys[req.id] = (-req.priority, req.arrival_s, 0)
    req.prefilled = 0
    req.admitted_step, req.status = b.step, PREFILLING
    b.running[req.id] = req
    own = b.projector.start(req, req.context_len, 0, b.step)
    b.committed += own
    b.tenants.reserved[req.tenant] += own
    b.reservations.track(req)
    b.running_changed()
    req.prefilled, req.status = req.context_len, DECODING
    b.projector.decodes(req, b.step)


def after_change(b: Batcher, rng: random.Random, candidate: Request, repeats: int) -> float:
    """Median of: one change of the running set (a finish, then putting it back), then one decision."""
    ids = list(b.running)  # the same set again after each put_back
    gone: list[Request] = []

    def change_then_decide() -> None:
        if gone:
            put_back(b, gone.pop())
        else:
            gone.append(b.finish(rng.choice(ids)))
        b.fits(candidate, limit=b.budget)

    b.fits(candidate, limit=b.budget)
    return median_us(change_then_decide, 2 * repeats)


def measure(block_size: int, repeats: int, running: int = RUNNING, kinds: tuple = ((1, 0),)) -> dict:
    b, rng = build(block_size, running, kinds=kinds)
    small = Request("small", 8, 8)
    small.reserved_new = 8
    committed = b.committed
    b.committed = 0  # pretend the batch is nearly empty: the naive sum fits
    fast = median_us(lambda: b.fits(small, limit=b.budget), repeats)
    b.committed = committed
    assert not naive_fits(b, small.reserved_total, 0, b.budget)
    mid = Request("mid", 64, 256)
    mid.reserved_new = 256
    projection = after_change(b, rng, mid, repeats)
    cached = median_us(lambda: b.fits(mid, limit=b.budget), repeats)
    b.schedule(2.0)  # a real pass: nothing fits, marks the batcher idle
    idle = median_us(lambda: b.schedule(2.0), repeats)

    def full_pass():
        b.idle = False
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


def report(block_size: int, repeats: int, running: int) -> dict:
    out = {"running": running, "waiting": running * WAITING // RUNNING, **measure(block_size, repeats, running)}
    out["block_size_1"] = {k: v for k, v in measure(1, repeats, running).items() if k != "block_size"}
    out["window_groups"] = {
        k: v for k, v in measure(block_size, repeats, running, GEMMA3_KINDS).items() if k != "block_size"
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    out = report(args.block_size, args.repeats, RUNNING)
    out["running_1024"] = report(args.block_size, args.repeats, 1024)
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()

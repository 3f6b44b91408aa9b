"""Cost of the admission call with 256 running and 1,024 waiting requests (and 1,024 running, 4,096 waiting).

    python -m bench.admission --json

fast_path_us:     one admission decision accepted by the naive sum (no projection).
projection_us:    one decision that needs the projection, right after the running set changed: a random
                  running request finishes, then the decision. The change is timed with it, since that
                  is when the profile is brought up to date (in place). A request of the same shape is
                  put back between samples (untimed), through the public API as an engine would.
projection_cached_us: the same decision with nothing changed since the last one.
idle_step_us:     schedule() on a step with nothing new to decide (the idle shortcut).
full_pass_us:     schedule() after a change in the queue, scanning the waiting requests (up to jump_scan past the first
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

RUNNING, WAITING = 256, 1024


# Gemma 3's layout: one page per block for the full layer, 5 for the window layers, a ring of
# ceil(511 / 16) + 1 = 33 blocks (engine/runner/kv_cache.py).
GEMMA3_KINDS = ((1, 0), (5, 33))


def config(block_size: int, budget: int, kinds: tuple) -> BatcherConfig:
    return BatcherConfig(
        max_batch_weight=budget,
        max_total_tokens=2048,
        max_prefill_weight=0,
        block_size=block_size,
        jump_window_s=1e9,
        max_wait_s=1e9,
        mode="worst_case",
        prefix_cache=False,
        kinds=kinds,
        windows=(512,) * (len(kinds) - 1),
    )


def admit_all(b: Batcher, requests: list[Request]) -> None:
    for req in requests:
        b.submit(req)
    while b.waiting:
        b.complete(b.schedule(0.0))


def running_set(running: int, seed: int) -> tuple[list[Request], int]:
    """The running requests, and the steps they have run (spread progress)."""
    rng = random.Random(seed)
    reqs = [Request(f"run{i}", rng.randint(16, 512), rng.randint(600, 1500), arrival_s=0.0) for i in range(running)]
    return reqs, rng.randint(50, 100)


def build(
    block_size: int, running: int = RUNNING, seed: int = 0, kinds: tuple = ((1, 0),)
) -> tuple[Batcher, random.Random]:
    """`running` requests mid-way, in a budget just above their projected peak (a full batch: only small
    requests could still join), and 4x as many waiting that cannot fit (admission scans and refuses them)."""
    roomy = Batcher(config(block_size, running * 2048 * (6 if len(kinds) > 1 else 1), kinds))
    reqs, steps = running_set(running, seed)
    admit_all(roomy, reqs)
    b = Batcher(config(block_size, roomy.projected_peak() + 100, kinds))
    reqs, steps = running_set(running, seed)
    admit_all(b, reqs)
    assert len(b.running) == running
    for _ in range(steps):  # spread the running requests' progress
        b.complete(b.schedule(0.0))
    for i in range(running * WAITING // RUNNING):
        b.submit(Request(f"wait{i}", 16, 2000, arrival_s=1.0))
    return b, random.Random(seed + 1)


def median_us(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return round(statistics.median(samples) / 1000, 2)


def after_change(b: Batcher, rng: random.Random, candidate: Request, repeats: int) -> float:
    """Median of: one change of the running set (a random request finishes), then one decision. A
    request of the same shape is put back afterwards, untimed (admitted, its prompt prefilled in one
    step), so that the running set keeps its size and shape."""
    samples = []
    for _ in range(repeats):
        rid = rng.choice(list(b.running))
        t0 = time.perf_counter_ns()
        gone = b.finish(rid)
        b.fits(candidate, limit=b.budget)
        samples.append(time.perf_counter_ns() - t0)
        b.submit(Request(rid, gone.input_len, gone.max_new_tokens, generated=gone.generated, arrival_s=0.0))
        plan = b.schedule(0.0)
        assert [r.id for r in plan.admitted] == [rid], "the put-back request did not fit again"
        b.complete(plan)
    return round(statistics.median(samples) / 1000, 2)


def measure(block_size: int, repeats: int, running: int = RUNNING, kinds: tuple = ((1, 0),)) -> dict:
    b, rng = build(block_size, running, kinds=kinds)
    small = Request("small", 8, 8)
    small.reserved_new = 8
    # the fast path's cost does not depend on the running set: a nearly empty batcher of the same shape
    light = Batcher(b.config)
    admit_all(light, [Request("one", 100, 100)])
    assert light.naive_fits(small.reserved_total, 0, light.budget)
    fast = median_us(lambda: light.fits(small, limit=light.budget), repeats)
    assert not b.naive_fits(small.reserved_total, 0, b.budget)
    mid = Request("mid", 64, 256)
    mid.reserved_new = 256
    projection = after_change(b, rng, mid, repeats)
    cached = median_us(lambda: b.fits(mid, limit=b.budget), repeats)
    b.schedule(2.0)  # a real pass: nothing fits, marks the batcher idle
    idle = median_us(lambda: b.schedule(2.0), repeats)
    samples = []
    for i in range(max(10, repeats // 10)):
        b.cancel(f"wait{i}")  # a change in the queue: the next pass is a real one
        b.submit(Request(f"wait{i}", 16, 2000, arrival_s=1.0))
        t0 = time.perf_counter_ns()
        b.schedule(2.0)
        samples.append(time.perf_counter_ns() - t0)
    return {
        "block_size": block_size,
        "fast_path_us": fast,
        "projection_us": projection,
        "projection_cached_us": cached,
        "idle_step_us": idle,
        "full_pass_us": round(statistics.median(samples) / 1000, 2),
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

"""What a Redis failover costs weightq's writes, measured: acknowledged writes lost, and the longest
time no write got through.

    python -m bench.failover --json

A local Sentinel group (the bundled redis-server: a master, two replicas, one sentinel) takes writes
made the way weightq makes its state writes (a script through `app.redis_conn.Durable`, retried
after a connection error or an unconfirmed write, so a retry is a no-op when the first try landed),
while the master is failed over (`SENTINEL FAILOVER`, the master alive) or SIGKILLed. Each
configuration in turn:

- async: plain asynchronous replication (REDIS_WAIT_REPLICAS=0);
- min-replicas: the servers run with `min-replicas-to-write 1` (`min-replicas-max-lag 1`);
- wait: REDIS_WAIT_REPLICAS=1 as well (each write waits until a replica has it);
- wait-all: REDIS_WAIT_REPLICAS=all (every replica the sentinels see up).

A write counts as acknowledged when the writer's call returned; it is lost if the master that the
sentinels name at the end does not hold it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import tempfile
import threading
import time

from weightq.cli.redis_server import SentinelGroup
from weightq.redis_conn import Durable, connect, is_transient
from weightq.settings import Settings

# Idempotent like weightq's own writes: a retry of a write that did land is a no-op.
WRITE = "if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then redis.call('RPUSH', KEYS[2], ARGV[1]) end return 1"

CONFIGS = {
    "async": ([], 0),
    "min-replicas": (["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"], 0),
    "wait": (["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"], 1),
    "wait-all": (["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"], "all"),
}


def measure(event: str, config: str, seconds_after: float = 16.0) -> dict:
    server_args, wait = CONFIGS[config]
    with tempfile.TemporaryDirectory(prefix="weightq-failover-") as home:
        group = SentinelGroup(home, server_args)
        settings = Settings(redis_wait_replicas=wait, redis_wait_timeout_ms=500)
        client = connect(group.sentinel.url, settings.redis, socket_timeout=2, socket_connect_timeout=1)
        durable = Durable(client, settings.redis.wait_replicas, settings.redis.wait_timeout_ms)
        script = client.register_script(WRITE)
        acked: list[tuple[int, float]] = []
        errors = 0
        stop = threading.Event()

        def writer() -> None:
            nonlocal errors
            i = 0
            while not stop.is_set():
                try:
                    durable.run(script, ["seen", "log"], [i])
                    acked.append((i, time.monotonic()))
                    i += 1
                except Exception as e:
                    if not is_transient(e):
                        raise
                    errors += 1
                    client.connection_pool.disconnect(inuse_connections=False)
                    time.sleep(0.05)

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        if event == "failover":
            group.sentinel.failover()
        else:
            os.kill(group.master.proc.pid, signal.SIGKILL)
        old = group.master.port
        deadline = t0 + 30
        while group.sentinel.master_port() == old and time.monotonic() < deadline:
            time.sleep(0.05)
        switched = time.monotonic() - t0
        time.sleep(seconds_after)
        stop.set()
        t.join(10)
        final = group.master_client(socket_timeout=5)
        stored = {int(x) for x in final.lrange("log", 0, -1)}
        group.stop()
    lost = [(i, ts) for i, ts in acked if i not in stored]
    times = [t0] + [ts for _, ts in acked if ts >= t0]
    gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
    return {
        "event": event,
        "config": config,
        "acknowledged": len(acked),
        "lost": len(lost),
        # when the lost writes were acknowledged, relative to the failover or kill (negative: before it)
        "lost_acked_from_s": round(lost[0][1] - t0, 3) if lost else None,
        "lost_acked_to_s": round(lost[-1][1] - t0, 3) if lost else None,
        "sentinels_switched_s": round(switched, 3),
        "longest_write_outage_s": round(gap, 3),
        "retried_writes": errors,
        "writes_per_s": round(len(acked) / (acked[-1][1] - acked[0][1]), 1) if len(acked) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--events", default="failover,kill")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    rows = [measure(e, c) for e in args.events.split(",") for c in args.configs.split(",")]
    if args.json:
        print(json.dumps({"bench": "failover", "rows": rows}, indent=1))
    else:
        for r in rows:
            print(
                f"{r['event']:8} {r['config']:12} acked {r['acknowledged']:7} lost {r['lost']:6} "
                f"outage {r['longest_write_outage_s']:6.2f} s  (sentinels switched after {r['sentinels_switched_s']} s)"
            )


if __name__ == "__main__":
    main()

"""Redis under Sentinel, for real: a master, two replicas and a sentinel (the bundled redis-server),
a worker and a client on a sentinel:// URL, the master failed over or killed mid-run. Every job
finishes once, with its whole output; its stream carries every token and exactly one end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from weightq.cli.processes import GatewayProcess, WorkerProcess
from weightq.cli.redis_server import SentinelGroup
from weightq.client import Client
from weightq.settings import Settings
from weightq.tasks.contract import EntryType, job_key, stream_key, token_parts

pytestmark = pytest.mark.service  # real Redis servers and worker processes

# Zero loss in a failover: every write of weightq's waits for all the replicas that are up.
HA = {"redis_wait_replicas": "all", "redis_wait_timeout_ms": 500}
SERVER = ["--min-replicas-to-write", "1", "--min-replicas-max-lag", "1"]


# A sentinel starved of CPU for 2 s (a busy machine) enters TILT and acts on nothing for 30 s. After
# it, a replica whose link to the dead master has been down longer than 10 x down-after is no
# candidate: with 1 s, no replica ever was ("-failover-abort-no-good-slave" until the test gave up).
# 4 s keeps every replica a candidate through a whole TILT.
DOWN_AFTER_MS = 4000


@pytest.fixture
def group(tmp_path):
    g = SentinelGroup(tmp_path, SERVER, down_after_ms=DOWN_AFTER_MS)
    yield g
    g.stop()


@pytest.fixture
def worker(group, tmp_path):
    w = WorkerProcess(
        group.url, "ha@test", tmp_path, max_batch_weight=8192, concurrency=64, visibility_timeout_s=10,
        lease_renew_s=1, lost_job_grace_s=3, recover_interval_s=1, **HA,
    )  # fmt: skip
    try:
        yield w.wait_ready()
    finally:
        try:
            w.stop()
        finally:
            w.kill()


@pytest.fixture
def gateway(group, tmp_path):
    g = GatewayProcess(group.url, tmp_path, **HA)
    try:
        yield g.wait_ready()
    finally:
        g.stop()


def check_once_and_whole(group: SentinelGroup, jobs, results, worker) -> None:
    r = group.master_client(decode_responses=True)
    for job, res in zip(jobs, results, strict=True):
        entries = [f for _, f in r.xrange(stream_key(job.id))]
        ends = [f for f in entries if f["type"] in (EntryType.END, EntryType.ERROR)]
        assert len(ends) == 1, (job.id, ends, worker.log()[-3000:])
        tokens: dict[int, int] = {}
        for f in entries:
            # a restarted attempt repeats indices, never changes them
            for p in token_parts(f) if f["type"] == EntryType.TOKEN else ():
                assert tokens.setdefault(int(p["i"]), int(p["id"])) == int(p["id"]), job.id
        assert [tokens[i] for i in range(len(tokens))] == res["token_ids"], (job.id, sorted(tokens)[:5])
        assert r.hget(job_key(job.id), "state") == "done"


def stream_over_http(base: str, out: dict) -> None:
    body = {"prompt": "through the gateway", "max_tokens": 96, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=180) as r:
        out["status"] = r.status_code
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    out["text"] = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    out["finish"] = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1]


def run_through(group: SentinelGroup, worker, gateway, event) -> None:
    client = Client(group.url, settings=Settings(redis_url=group.url, **HA))
    jobs = [client.submit(f"sentinel {i}", max_new_tokens=96, ignore_eos=True) for i in range(12)]
    http: dict = {}
    follower = threading.Thread(target=stream_over_http, args=(gateway.base, http))
    follower.start()
    next(jobs[-1].stream(timeout=120))  # every job admitted and streaming
    late: list = []
    submitter = threading.Thread(
        target=lambda: late.extend(client.submit(f"late {i}", max_new_tokens=16, ignore_eos=True) for i in range(4))
    )
    old = group.sentinel.master_port()
    event()
    submitter.start()  # submissions while the group fails over wait it out, then land once
    deadline = time.monotonic() + 60
    while group.sentinel.master_port() == old:
        assert time.monotonic() < deadline, "the sentinel did not fail over"
        time.sleep(0.1)
    submitter.join(120)
    assert len(late) == 4
    jobs += late
    streamed = [("".join(job.stream(timeout=180)), job) for job in jobs]  # each job read from the start
    results = [job.result(timeout=180) for job in jobs]
    for (text, _), res in zip(streamed, results, strict=True):
        assert text == res["text"]
    assert [res["usage"]["completion_tokens"] for res in results] == [96] * 12 + [16] * 4
    check_once_and_whole(group, jobs, results, worker)
    # Greedy: the same request after the failover gives the same tokens.
    again = client.submit("sentinel 0", max_new_tokens=96, ignore_eos=True).result(timeout=120)
    assert again["token_ids"] == results[0]["token_ids"]
    assert worker.proc.poll() is None
    follower.join(180)  # an HTTP client streaming across the failover gets every token once
    same = client.submit("through the gateway", max_new_tokens=96, ignore_eos=True).result(timeout=120)
    assert (http["status"], http["finish"], http["text"]) == (200, "length", same["text"])


def test_sentinel_failover_mid_run_loses_and_doubles_nothing(group, worker, gateway):
    run_through(group, worker, gateway, group.sentinel.failover)


def test_master_sigkilled_mid_run_loses_and_doubles_nothing(group, worker, gateway):
    run_through(group, worker, gateway, lambda: os.kill(group.master.proc.pid, signal.SIGKILL))

"""The gateway's group commit takes pending submissions tenant by tenant (app/gateway/submitter.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import redis
from weightq.client import Client
from weightq.gateway.submitter import Submitter, fair_batch
from weightq.tasks.request import JobRequest


@dataclass
class Job:
    tenant: str
    name: str


def names(items) -> list[str]:
    return [job.name for job, _ in items]


def test_a_batch_takes_each_tenant_in_turn_and_keeps_each_ones_order():
    pending = [(Job("flood", f"f{i}"), None) for i in range(300)] + [(Job("light", "l0"), None)]
    batch, rest = fair_batch(pending, 4)
    assert names(batch) == ["f0", "l0", "f1", "f2"] and names(rest) == [f"f{i}" for i in range(3, 300)]


def test_one_tenant_is_first_come_first_served():
    pending = [(Job("t", str(i)), None) for i in range(10)]
    batch, rest = fair_batch(pending, 4)
    assert names(batch) == ["0", "1", "2", "3"] and len(rest) == 6


class SecondCommitFails:
    """A real client whose second group commit meets Redis gone (past REDIS_RETRY_S)."""

    def __init__(self, client) -> None:
        self.client, self.commits = client, 0

    def submit_many(self, jobs, **kw):
        self.commits += 1
        if self.commits == 2:
            raise redis.ConnectionError("Redis went away")
        return self.client.submit_many(jobs, **kw)

    def job(self, job_id: str):
        return self.client.job(job_id)


@pytest.mark.service
def test_a_request_whose_jobs_fail_in_part_cancels_those_submitted(redis_url):
    client = Client(redis_url)
    client.redis.flushall()
    submitter = Submitter(SecondCommitFails(client), max_batch=2)  # type: ignore[arg-type]
    jobs = [JobRequest(prompt=f"choice {i}", max_new_tokens=4) for i in range(3)]  # two commits: 2 + 1
    with pytest.raises(redis.ConnectionError):
        asyncio.run(submitter.submit_all(jobs))  # waits for the executor's cancels
    states = [client.redis.hget(key, "state") for key in client.redis.scan_iter("weightq:job:*")]
    assert states == [b"cancelled", b"cancelled"]  # nobody would have read them

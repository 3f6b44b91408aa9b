"""Results and streams that answer (issue 40): an id no job has fails at once, a finished job's result
outlives its stream (RESULT_TTL_S, not STREAM_TTL_S), and an expired stream says so. A real Redis and,
where a job must run, a real worker on the simulated device."""

from __future__ import annotations

import json
import time

import pytest
import redis
from weightq.client import JobExpired, JobNotFound, StreamExpired
from weightq.tasks.contract import job_key, stream_key

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def test_an_id_no_job_has_fails_at_once(service):
    job = service.client.job("never-submitted")
    t0 = time.monotonic()
    with pytest.raises(JobNotFound, match="never-submitted"):
        job.result(timeout=30)
    with pytest.raises(JobNotFound):
        next(iter(job.stream()))
    assert time.monotonic() - t0 < 5


def test_a_queued_job_without_a_worker_waits_and_times_out_not_missing(service):
    job = service.client.submit("nobody takes this yet", max_new_tokens=4)
    with pytest.raises(TimeoutError):
        job.result(timeout=2)


def test_a_finished_jobs_result_outlives_its_stream(service):
    service.worker(runner="simulated", sim_step_cost="0.001,0,0").wait_ready()
    job = service.client.submit("keep my result", max_new_tokens=6)
    want = job.result(timeout=60)
    r = redis.Redis.from_url(service.url)
    assert r.ttl(job_key(job.id)) > r.ttl(stream_key(job.id)) > 0  # RESULT_TTL_S (a day) > STREAM_TTL_S (an hour)
    r.delete(stream_key(job.id))  # the stream's hour has passed
    assert job.result(timeout=5) == want
    with pytest.raises(StreamExpired, match="result"):
        list(job.stream(timeout=5))


def test_an_error_outlives_its_stream_as_the_same_exception(service):
    r = redis.Redis.from_url(service.url)
    r.hset(job_key("late"), mapping={"state": "done", "error": "deadline: it passed", "field": "deadline"})
    with pytest.raises(JobExpired, match="deadline"):
        service.client.job("late").result(timeout=5)
    r.hset(job_key("gone"), mapping={"state": "cancelled", "result": json.dumps({"finish_reason": "cancelled"})})
    assert service.client.job("gone").result(timeout=5) == {"finish_reason": "cancelled"}

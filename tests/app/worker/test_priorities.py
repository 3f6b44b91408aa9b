"""Priority classes through Redis and a real worker: the broker takes the urgent class first, the
engine admits it ahead of queued background work, and the lost-job sweep never mistakes a long
queued low-priority job for a lost one."""

from __future__ import annotations

import pytest
import redis
from weightq.tasks.contract import job_key, staged_sets, stream_key
from weightq.transport import priority_queues

pytestmark = pytest.mark.service  # real Redis servers and worker processes


def attempt_ids(r: redis.Redis, job_id: str) -> list[str]:
    return [i.decode() for i, f in r.xrange(stream_key(job_id)) if f[b"type"] == b"attempt"]


def ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


def test_an_interactive_job_starts_ahead_of_500_queued_background_jobs(service):
    r = redis.Redis.from_url(service.url)
    background = [
        {"prompt_token_ids": [10 + i % 50, 20, 30], "max_new_tokens": 24, "ignore_eos": True, "priority": 0}
        for i in range(500)
    ]
    jobs = service.client.submit_many(background)
    # class 0: the last the broker takes (staged for it: FAIR_QUEUE)
    assert r.zcard(staged_sets("weightq")[9]) + r.llen(priority_queues("weightq")[9]) == 500
    service.worker(concurrency=16).wait_ready()
    jobs[0].result(timeout=120)  # the worker is busy with background work
    now = r.time()
    submitted_ms = now[0] * 1000 + now[1] // 1000
    urgent = service.client.submit(prompt_token_ids=[5, 6, 7], max_new_tokens=8, priority=9)
    result = urgent.result(timeout=120)
    assert result["usage"]["completion_tokens"] == 8
    started_ms = ms(attempt_ids(r, urgent.id)[0])
    began = [ms(a[0]) for job in jobs if (a := attempt_ids(r, job.id))]
    # it waited for no more background jobs than one worker holds at once (CONCURRENCY)
    assert sum(submitted_ms <= t < started_ms for t in began) <= 16
    assert len(began) < 250, "the interactive job waited behind the backlog"


def test_a_long_queued_low_priority_job_is_never_sent_again(service):
    """Later jobs of a higher class start first; the low one waits through several sweeps that see
    started jobs submitted after it, in a list of its own. It runs once."""
    r = redis.Redis.from_url(service.url)
    low = service.client.submit("background", max_new_tokens=4, priority=0)
    high = service.client.submit_many(
        [{"prompt": f"urgent {i}", "max_new_tokens": 256, "ignore_eos": True, "priority": 9} for i in range(16)]
    )
    worker = service.worker(concurrency=2, lost_job_grace_s=1, recover_interval_s=1)
    worker.wait_ready()
    for job in high:
        job.result(timeout=120)
    result = low.result(timeout=120)
    assert result["attempt"] == 1
    assert len(attempt_ids(r, low.id)) == 1
    assert r.hget(job_key(low.id), "attempt") == b"1"
    assert "lost its message" not in worker.log()  # never sent again
    # the high jobs started first (they came later, in a more urgent list)
    assert ms(attempt_ids(r, low.id)[0]) >= max(ms(attempt_ids(r, j.id)[0]) for j in high)


def test_a_plain_celery_app_configured_as_the_readme_says_files_a_class_where_weightq_takes_it(service):
    """Sent by name with priority 4 (class 5): with kombu's ten priority steps, in class 5's list; with
    kombu's default four, in class 6's (what the README warns of)."""
    from celery import Celery

    r = redis.Redis.from_url(service.url)
    lists = priority_queues("weightq")
    for steps, want in (({"priority_steps": list(range(10)), "queue_order_strategy": "priority"}, 4), ({}, 3)):
        app = Celery(broker=service.url, backend=service.url)
        app.conf.broker_transport_options = steps
        app.send_task("weightq.generate", args=[{"prompt": "Hi", "priority": 5}], queue="weightq", priority=4)
        assert [r.llen(q) for q in lists].index(1) == want  # lists[i] is class 9 - i
        r.delete(*lists)


def test_a_worker_started_with_fewer_threads_than_concurrency_still_keeps_one_for_interactive_work(service):
    """`weightq worker -c 4` with CONCURRENCY=64 in the environment: the worker plans for the 4 threads
    its pool runs, so background jobs leave one to the urgent classes (INTERACTIVE_SLOTS resolves to 1),
    and an interactive job starts while every background job still runs. Planned for 64, it would have
    prefetched every background job onto 4 threads, the interactive one queued behind them."""
    r = redis.Redis.from_url(service.url)
    sim = dict(runner="simulated", sim_step_cost="0.01,0,0", max_batch_weight=8192)  # 10 ms a step
    worker = service.worker(argv=("-c", "4"), concurrency=64, **sim).wait_ready()
    assert worker.wait_stats(lambda s: "threads" in s)["threads"] == 4
    background = service.client.submit_many(
        [{"prompt_token_ids": [9, i, 7], "max_new_tokens": 400, "ignore_eos": True, "priority": 0} for i in range(8)]
    )
    worker.wait_stats(lambda s: s.get("active_jobs", 0) >= 3)
    urgent = service.client.submit(prompt_token_ids=[5, 6, 7], max_new_tokens=4, priority=9)
    assert urgent.result(timeout=60)["usage"]["completion_tokens"] == 4
    ended = [j.id for j in background if r.hget(job_key(j.id), "state") == b"done"]
    assert not ended, f"the interactive job waited for background jobs to finish: {ended}"
    for job in background:
        job.cancel()

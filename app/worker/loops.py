"""The worker's background loops, one concern each:
- cancellation: a client's cancel (published on a channel) or a Celery revoke reaches the engine
  within CANCEL_POLL_S; the job's cancel flag stays in Redis for a run that starts later;
- leases: the worker re-stamps its in-flight messages in kombu's `unacked_index`, so only a
  dead worker's jobs outlive the visibility timeout and are redelivered (its own lease, and the
  reaper that resumes a dead worker's jobs within seconds, are lease.py and reaper.py);
- intake (intake.py): staged jobs released, and the consumer's prefetch set, from what the engine
  can start, so several workers on one queue share it and none hoards jobs it cannot start;
- recovery (recovery.py) and the heartbeat (the worker's stats, for the gateway, `weightq batch` and Flower).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from weightq.engine import AnyEngine
from weightq.redis_conn import is_transient
from weightq.settings import WorkerSettings
from weightq.tasks import heartbeat
from weightq.tasks.contract import CANCEL_CHANNEL, HEARTBEATS

from .inflight import InFlight

log = logging.getLogger(__name__)

RESTART_S = 1.0  # the pause before a loop that raised runs again (Redis away: no busy retrying)
CANCEL_POLL_S = 0.05  # one pass over the cancel channels: how late a cancel may reach the engine
HEARTBEAT_S = 1.0  # how often the worker publishes its stats (clients route by them)


def run_guarded(name: str, loop: Callable[[], None], stop: threading.Event) -> threading.Thread:
    """Run `loop` on a daemon thread until `stop`, restarting it (after RESTART_S) if it raises."""

    def run() -> None:
        while not stop.is_set():
            try:
                loop()
            except Exception as e:
                if is_transient(e):  # Redis restarting or failing over: one line, not a traceback
                    log.warning("the %s loop: Redis unavailable (%s); restarting it", name, e)
                else:
                    log.exception("the %s loop failed; restarting it", name)
                stop.wait(RESTART_S)

    t = threading.Thread(target=run, name=f"weightq-{name}", daemon=True)
    t.start()
    return t


def cancel_loop(shards: list[redis.Redis], engine: AnyEngine, inflight: InFlight, stop: threading.Event) -> None:
    """Cancels arrive as a publish on CANCEL_CHANNEL (clients; on the shard of the job's keys) or a
    Celery revoke (control)."""
    from celery.worker import state

    subs = [client.pubsub(ignore_subscribe_messages=True) for client in shards]
    try:
        for pubsub in subs:
            pubsub.subscribe(CANCEL_CHANNEL)
        while not stop.is_set():
            for pubsub in subs:
                message = pubsub.get_message(timeout=CANCEL_POLL_S / len(subs))
                if message is not None:
                    data = message["data"]
                    engine.cancel(data.decode() if isinstance(data, bytes) else data)
            for job_id in inflight.ids():
                if job_id in state.revoked:
                    engine.cancel(job_id)
    finally:
        for pubsub in subs:
            pubsub.close()


def restamp_loop(
    client: redis.Redis, conf: WorkerSettings, inflight: InFlight, consumer: Callable[[], Any], stop
) -> None:
    """Every LEASE_RENEW_S, the messages this worker holds are stamped as delivered now, so that kombu's
    visibility timeout never restores a job that is running (not the worker's own lease: lease.py)."""
    while not stop.wait(conf.lease_renew_s):
        tags = delivered_tags(inflight, consumer())
        if tags:
            # XX: only re-stamp messages still unacked; never resurrect an acked one.
            client.zadd("unacked_index", dict.fromkeys(tags, time.time()), xx=True)


def delivered_tags(inflight: InFlight, consumer: Any) -> list[str]:
    """Tags of the messages this worker holds: its running jobs' own (they outlive a broker
    reconnect, which gives the consumer a fresh channel) and what the channel has delivered."""
    tags = inflight.tags()
    try:
        delivered = consumer.task_consumer.channel.qos._delivered  # kombu's virtual QoS
    except AttributeError:
        return list(tags)
    for _ in range(3):
        try:
            return list(tags.union(delivered))
        except RuntimeError:  # changed size during iteration: another thread acked
            continue
    return list(tags)


def pipe_counts(inflight: InFlight, consumer: Any) -> tuple[int, int]:
    """(messages the consumer took that no task has brought into the engine yet, messages whose job
    left the engine and whose ack has not been made yet): the second hold kombu's prefetch but no
    room. Acked ones count in neither: kombu drops an acked tag from its delivered map only at its
    next delivery, so an idle worker's map still lists the jobs it finished."""
    try:
        qos = consumer.task_consumer.channel.qos
    except AttributeError:
        return 0, 0
    for _ in range(3):
        try:
            outstanding = set(qos._delivered) - set(qos._dirty)
        except RuntimeError:  # changed size during the copy: another thread acked
            continue
        return inflight.pending(outstanding)
    return 0, 0


def delivery_tag_of(consumer: Any, job_id: str) -> str | None:
    """The delivery tag of the job's message, from the consumer's delivered messages (the task cannot
    tell: Celery's delivery_info leaves it out)."""
    try:
        delivered = consumer.task_consumer.channel.qos._delivered
    except AttributeError:
        return None
    for _ in range(100):
        try:
            held = list(delivered.items())
        except RuntimeError:  # changed size during the copy: the consumer took or acked one
            continue
        return next((t for t, m in reversed(held) if (m.headers or {}).get("id") == job_id), None)
    return None


def heartbeat_loop(client: redis.Redis, hostname: str, stats: Callable[[], dict], stop) -> None:
    while not stop.wait(HEARTBEAT_S):
        client.hset(HEARTBEATS, hostname, heartbeat.encode(stats()))

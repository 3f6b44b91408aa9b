"""The consumer's batch take (app/transport.py TAKE) and batched acks against a real Redis, through kombu itself."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub, get_event_loop, set_event_loop
from kombu.asynchronous.timer import Timer
from weightq.transport import KOMBU_5_7, priority_queues, publish_batch, wake_poller

pytestmark = pytest.mark.service  # real Redis servers and worker processes

OPTIONS = {"priority_steps": list(range(10)), "queue_order_strategy": "priority"}


def _connect(url: str, **options) -> Connection:
    return Connection(url, transport="weightq.transport:Transport", transport_options={**OPTIONS, **options})


def _delivered(conn: Connection, name: str, n: int) -> tuple[object, list]:
    """n messages published to queue `name`, then delivered on a channel of their own with room for
    all of them: (the channel, the messages)."""
    queue = Queue(name, Exchange(name, type="direct"), routing_key=name)
    producer = Producer(conn.channel(), exchange=queue.exchange, routing_key=name)
    queue(producer.channel).declare()
    for i in range(n):
        producer.publish({"i": i, "args": [None, None]})
    got: list = []
    channel = conn.channel()
    channel.basic_qos(prefetch_count=n)
    Consumer(channel, [queue], callbacks=[lambda body, message: got.append(message)]).consume()
    conn.drain_events(timeout=5)
    return channel, got


def test_one_drain_takes_a_burst_in_priority_order_and_records_each_as_unacked(service):
    r = redis.Redis.from_url(service.url)
    queue = Queue("burst", Exchange("burst", type="direct"), routing_key="burst")
    with _connect(service.url) as conn:
        producer = Producer(conn.channel(), exchange=queue.exchange, routing_key="burst")
        queue(producer.channel).declare()
        for i in range(12):
            producer.publish({"i": i, "args": [None, None]}, priority=0 if i >= 9 else 5)
        got = []
        channel = conn.channel()
        channel.basic_qos(prefetch_count=8)
        consumer = Consumer(channel, [queue], callbacks=[lambda body, message: got.append((body, message))])
        with consumer:
            conn.drain_events(timeout=5)
            # one BRPOP, then the rest of the prefetch room in one script call: 8 messages, the three
            # urgent ones first, each recorded as unacked until acked
            assert len(got) == 8
            assert [b["i"] for b, _ in got[:3]] == [9, 10, 11]
            assert [b["i"] for b, _ in got[3:]] == [0, 1, 2, 3, 4]
            assert got[0][0]["args"] == [None, None]  # the payload byte for byte
            assert r.hlen(channel.unacked_key) == 8 and r.zcard(channel.unacked_index_key) == 8
            assert sum(r.llen(q) for q in priority_queues("burst")) == 4
            for _, message in got[:5]:
                message.ack()
            assert r.hlen(channel.unacked_key) == 3
            got[5][1].reject(requeue=True)  # back to its list, then delivered again
            assert r.hlen(channel.unacked_key) == 2
            for _, message in got[6:]:
                message.ack()
            while len(got) < 13:
                conn.drain_events(timeout=5)
            assert sorted(b["i"] for b, _ in got[8:]) == [2, 5, 6, 7, 8]  # nothing lost, nothing twice
            for _, message in got[8:]:
                message.ack()
            assert r.hlen(channel.unacked_key) == 0 and r.zcard(channel.unacked_index_key) == 0


def test_acks_on_the_event_loop_leave_redis_together_at_the_end_of_its_turn(service):
    r = redis.Redis.from_url(service.url)

    def multis() -> int:
        return r.info("commandstats").get("cmdstat_multi", {}).get("calls", 0)

    with _connect(service.url) as conn:
        channel, got = _delivered(conn, "acks", 8)
        assert len(got) == 8 and r.hlen(channel.unacked_key) == 8
        before, hub = get_event_loop(), set_event_loop(Hub())
        try:
            seen = []

            def ack_three() -> None:  # as Celery's consumer acks: callbacks run in one turn of its loop
                for message in got[:3]:
                    message.ack()
                seen.append((r.hlen(channel.unacked_key), channel.qos.can_consume_max_estimate()))

            multi0 = multis()
            hub.call_soon(ack_three)
            next(hub.create_loop())  # one turn: the callbacks, then on_tick
            assert seen == [(8, 3)]  # still recorded during the turn, yet their prefetch room is back
            assert r.hlen(channel.unacked_key) == 5 and r.zcard(channel.unacked_index_key) == 5
            assert multis() - multi0 == 1  # one transaction for the three
            other = threading.Thread(target=got[3].ack)  # off the loop's thread: at once
            other.start()
            other.join()
            assert r.hlen(channel.unacked_key) == 4
            hub.call_soon(lambda: [m.ack() for m in got[4:]])
            hub.close()  # the loop turns no more: the acks it runs as it closes go at once
            assert r.hlen(channel.unacked_key) == 0 and r.zcard(channel.unacked_index_key) == 0
            assert not hub.on_close and not hub.on_tick  # the hub holds on to no closed channel
        finally:
            set_event_loop(before)


def test_acks_pending_when_their_channel_closes_leave_first_on_its_own_connection(service):
    r = redis.Redis.from_url(service.url)
    with _connect(service.url) as conn:
        channel, got = _delivered(conn, "closing", 4)
        assert len(got) == 4 and r.hlen(channel.unacked_key) == 4
        clients = len(r.client_list())
        before, hub = get_event_loop(), set_event_loop(Hub())
        try:

            def ack_and_close() -> None:  # a turn that acks, then loses its channel (a broker reconnect)
                for message in got:
                    message.ack()
                channel.close()

            hub.call_soon(ack_and_close)
            next(hub.create_loop())
        finally:
            set_event_loop(before)
        assert r.hlen(channel.unacked_key) == 0 and r.zcard(channel.unacked_index_key) == 0
        # both its connections (commands, BRPOP) closed, and no third one opened for the acks after them
        assert len(r.client_list()) == clients - 2


@contextmanager
def _running_loop(conn: Connection) -> Iterator[Hub]:
    """A hub the transport is registered with, as Celery's consumer registers it, turning in a thread
    of its own (as Celery's event loop turns in the worker's main thread). Its timer lets a poll wait
    as long as the hub allows (10 s) when nothing is due sooner."""
    hub, stop = Hub(Timer(max_interval=60)), threading.Event()
    conn.transport.register_with_event_loop(conn.connection, hub)
    loop = hub.create_loop()

    def turn() -> None:
        while not stop.is_set():
            next(loop)

    thread = threading.Thread(target=turn, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        stop.set()
        hub.call_soon(lambda: None)
        wake_poller(hub)
        thread.join(30)
        hub.close()


def test_a_callback_queued_from_another_thread_ends_the_loops_poll(service):
    """The worker's intake releases jobs from a thread of its own and wakes the loop to take them: the
    wake must end a poll that would otherwise wait for the next timer (up to 10 s), or the released
    jobs sit in the lists meanwhile, for another worker to steal (kombu 5.6: LoopBackport)."""
    silent = socket.socketpair()  # a connection the loop watches and nothing arrives on (an idle BRPOP)
    with _connect(service.url) as conn, silent[0], silent[1]:
        conn.connect()
        with _running_loop(conn) as hub:
            hub.add_reader(silent[0], lambda: None)  # a loop with nothing to watch only naps
            hub.call_later(60, lambda: None)  # nothing due for a minute: each poll waits its longest (10 s)
            first, woken = threading.Event(), threading.Event()
            hub.call_soon(first.set)
            assert first.wait(30)
            time.sleep(0.2)  # the loop is in its poll now
            hub.call_soon(woken.set)
            wake_poller(hub)
            assert woken.wait(5), "a callback queued from another thread waited for the loop's poll to time out"


def test_the_visibility_sweep_runs_at_the_interval_the_options_ask_for(service):
    """unacked_restore_interval / unacked_restore_throttle (set by celery_config from RESTORE_INTERVAL_S):
    an unacked message past its visibility timeout is back in its list within seconds, not kombu 5.6's
    fixed 100 s."""
    r = redis.Redis.from_url(service.url)
    fast = dict(visibility_timeout=1, unacked_restore_interval=1, unacked_restore_throttle=1, unacked_mutex_expire=5)
    with _connect(service.url, **fast) as conn:
        channel, got = _delivered(conn, "expiring", 1)  # delivered, never acked: its worker went silent
        assert len(got) == 1 and r.hlen(channel.unacked_key) == 1
        with _running_loop(conn):
            deadline = time.monotonic() + 30
            while r.hlen(channel.unacked_key) and time.monotonic() < deadline:
                time.sleep(0.1)
        assert r.hlen(channel.unacked_key) == 0, "the visibility sweep did not restore an expired message"
        assert sum(r.llen(q) for q in priority_queues("expiring")) == 1


def test_a_submissions_messages_leave_in_one_pipeline_where_kombu_batches(service):
    """publish_batch: kombu 5.7's Producer.batch, whose pipeline `_put` joins; kombu 5.6 has none, and
    each message is published on its own (the same messages either way)."""
    r = redis.Redis.from_url(service.url)
    queue = Queue("batched", Exchange("batched", type="direct"), routing_key="batched")
    with _connect(service.url) as conn:
        producer = Producer(conn.channel(), exchange=queue.exchange, routing_key="batched")
        queue(producer.channel).declare()
        with publish_batch(producer, 8):
            for i in range(5):
                producer.publish({"i": i})
            # kombu 5.7: buffered until the context ends (Producer.batch); 5.6: each sent at once
            assert r.llen("batched") == (0 if KOMBU_5_7 else 5), "kombu 5.7's Producer.batch did not batch"
        assert r.llen("batched") == 5

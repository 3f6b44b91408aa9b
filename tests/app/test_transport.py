"""The consumer's batch take (app/transport.py TAKE) and batched acks against a real Redis, through kombu itself."""

from __future__ import annotations

import threading

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub, get_event_loop, set_event_loop
from weightq.transport import priority_queues

pytestmark = pytest.mark.service  # real Redis servers and worker processes

OPTIONS = {"priority_steps": list(range(10)), "queue_order_strategy": "priority"}


def _connect(url: str) -> Connection:
    return Connection(url, transport="weightq.transport:Transport", transport_options=OPTIONS)


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

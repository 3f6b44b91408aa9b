"""The kombu internals weightq still touches (app/transport.py's docstring lists them and why), checked
by name, signature and storage format: a kombu release that renames, drops or reshapes one fails here,
by name, before the queue misbehaves in a running worker. weightq supports kombu 5.6 and 5.7 (each with
Celery of its minor): CI runs the suite on the newest, and `make test-kombu-prev` runs this file and the
other kombu-sensitive tests on 5.6."""

from __future__ import annotations

import inspect
import json

import kombu
import pytest
from kombu import Producer
from kombu.asynchronous import Hub
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from weightq.transport import KOMBU_5_7

REDIS_CHANNEL = {
    # (name, parameters it must accept): why weightq needs it
    "_put": ("queue", "message"),  # staged messages go to a sorted set (STAGE) instead of a list
    "_brpop_read": (),  # a transient ResponseError reconnects; then the batch take (TAKE)
    "_do_restore_message": ("payload", "exchange", "routing_key", "pipe", "leftmost"),  # fresh tag, shared queue
    "_q_for_pri": ("queue", "pri"),  # a priority's list name: TAKE and a stale channel's requeue
    "_get_message_priority": ("message", "reverse"),  # a staged message's priority
    "basic_ack": ("delivery_tag",),  # an ack on a stale channel
    "basic_reject": ("delivery_tag", "requeue"),  # a reject on a stale channel
    "conn_or_acquire": (),  # the channel's own client for STAGE
    "close": (),  # batched acks go before kombu's close restores
}
REDIS_ATTRIBUTES = ("unacked_key", "unacked_index_key", "sep", "priority_steps", "do_restore", "QoS")


@pytest.mark.parametrize("name", sorted(REDIS_CHANNEL))
def test_the_redis_channel_methods_weightq_overrides_or_calls_are_there(name):
    method = getattr(kombu_redis.Channel, name, None)
    assert callable(method), f"kombu's Redis Channel has no {name}"
    params = inspect.signature(method).parameters
    missing = [p for p in REDIS_CHANNEL[name] if p not in params]
    assert not missing, f"kombu's Channel.{name} no longer takes {missing}"


def test_the_redis_channel_attributes_and_key_names_are_there():
    for name in REDIS_ATTRIBUTES:
        assert hasattr(kombu_redis.Channel, name), f"kombu's Redis Channel has no {name}"
    # the unacked record's names: app/worker/reaper.py and the TAKE script write and read them
    assert kombu_redis.Channel.unacked_key == "unacked" and kombu_redis.Channel.unacked_index_key == "unacked_index"
    assert kombu_redis.Channel.sep == "\x06\x16"  # a priority list is queue + sep + priority
    source = inspect.getsource(kombu_redis.Channel) + inspect.getsource(virtual.Channel)
    for attr in ("self.active_queues", "self.global_keyprefix", "self._qos"):
        assert attr in source, f"kombu's Redis Channel no longer keeps {attr}"


def test_the_qos_weightq_extends_keeps_its_delivered_map_and_methods():
    for name in ("ack", "append", "restore_unacked_once", "pipe_or_acquire", "can_consume_max_estimate"):
        assert callable(getattr(kombu_redis.QoS, name, None)), f"kombu's Redis QoS has no {name}"
    # BatchedQoS.restore_visible passes the throttle on kombu 5.6, as 5.7's poller does
    params = list(inspect.signature(kombu_redis.QoS.restore_visible).parameters)
    assert params == ["self", "start", "num", "interval"], f"kombu's QoS.restore_visible takes {params} now"
    assert list(inspect.signature(virtual.QoS.append).parameters) == ["self", "message", "delivery_tag"]
    assert list(inspect.signature(virtual.QoS.ack).parameters) == ["self", "delivery_tag"]
    # the worker counts its held messages from these (app/worker/loops.py: pipe_counts, delivered_tags)
    init = inspect.getsource(virtual.QoS.__init__)
    assert "self._delivered" in init and "self._dirty" in init, "virtual.QoS no longer keeps _delivered/_dirty"


def test_the_unacked_record_is_payload_exchange_routing_key():
    """TAKE writes the record kombu's QoS.append would (and the reaper reads it back): a JSON list of
    the payload, its exchange and its routing key, in kombu's unacked hash under the delivery tag."""
    source = " ".join(inspect.getsource(kombu_redis.QoS.append).split())
    assert "dumps([message._raw, EX, RK])" in source, "kombu's QoS.append records unacked messages differently"
    raw = kombu_redis.dumps([{"body": "b"}, "ex", "rk"])
    assert json.loads(raw) == [{"body": "b"}, "ex", "rk"] and kombu_redis.loads(raw)[2] == "rk"


def test_the_transport_delivers_a_taken_message_and_the_hub_has_its_callback_sets():
    assert "queue" in inspect.signature(virtual.Transport._deliver).parameters  # TAKE's messages delivered
    hub = Hub()
    try:
        assert isinstance(hub.on_tick, set) and isinstance(hub.on_close, set)  # batched acks flush on a tick
        for name in ("call_soon", "call_repeatedly", "add_reader"):  # LoopBackport's, on kombu 5.6
            assert callable(getattr(hub, name, None)), f"kombu's Hub has no {name}"
    finally:
        hub.close()


def test_the_minor_versions_and_their_differences_are_the_ones_weightq_handles():
    """kombu 5.6 and 5.7 only: a newer minor may move what app/transport.py's docstring lists. On 5.7 the
    hub wakes itself (tests/app/test_transport.py checks it does) and Producer.batch exists; on 5.6 the
    transport's register_with_event_loop adds the LoopBackport, whose sweep is the poller's own."""
    assert kombu.VERSION[:2] in ((5, 6), (5, 7)), f"kombu {kombu.__version__}: check app/transport.py's list"
    for transport in (kombu_redis.Transport, kombu_redis.SentinelTransport):
        params = list(inspect.signature(transport.register_with_event_loop).parameters)
        assert params == ["self", "connection", "loop"], f"kombu's register_with_event_loop takes {params} now"
    assert callable(getattr(kombu_redis.MultiChannelPoller, "maybe_restore_messages", None)), (
        "kombu's MultiChannelPoller has no maybe_restore_messages"
    )
    if KOMBU_5_7:
        assert "max_size" in inspect.signature(Producer.batch).parameters, "kombu's Producer.batch changed"
        assert "_publish_batch" in inspect.getsource(kombu_redis.Channel), "kombu no longer passes _publish_batch"

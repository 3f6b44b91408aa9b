"""The route key and the rendezvous choice of prefix affinity (tasks/affinity.py)."""

from __future__ import annotations

from collections import Counter

from weightq.tasks.affinity import rendezvous, route_key
from weightq.tasks.request import JobRequest, Message

SYSTEM = "You are a careful assistant for the ACME support desk. " * 8  # > 256 characters


def test_prompts_that_share_their_first_characters_share_a_key():
    a = route_key(JobRequest(prompt=SYSTEM + "Where is my parcel?"), 256)
    b = route_key(JobRequest(prompt=SYSTEM + "Cancel my order."), 256)
    assert a == b
    # a difference inside the prefix is another key; so is a shorter key length's view of both
    assert route_key(JobRequest(prompt="X" + SYSTEM), 256) != a
    assert route_key(JobRequest(prompt="short"), 256) != route_key(JobRequest(prompt="shorter"), 256)


def test_the_key_holds_the_tenant_unless_the_cache_is_shared():
    a = JobRequest(prompt=SYSTEM, tenant="alice")
    b = JobRequest(prompt=SYSTEM, tenant="bob")
    assert route_key(a, 256) != route_key(b, 256)
    assert route_key(a, 256, shared_cache=True) == route_key(b, 256, shared_cache=True)


def test_token_ids_and_chat_messages_have_keys_of_their_own():
    ids = list(range(10, 400))
    assert route_key(JobRequest(prompt_token_ids=ids), 256) == route_key(JobRequest(prompt_token_ids=ids[:64]), 256)
    assert route_key(JobRequest(prompt_token_ids=ids), 256) != route_key(JobRequest(prompt_token_ids=ids[1:]), 256)
    chat = (Message("system", SYSTEM), Message("user", "hi"))
    follow_up = (*chat, Message("assistant", "hello"), Message("user", "and then?"))
    assert route_key(JobRequest(messages=chat), 256) == route_key(JobRequest(messages=follow_up), 256)
    other = (Message("system", "Another system prompt entirely."), Message("user", "hi"))
    assert route_key(JobRequest(messages=other), 256) != route_key(JobRequest(messages=chat), 256)


def test_rendezvous_is_stable_balanced_and_moves_only_a_leaving_workers_keys():
    workers = [f"w{i}@host" for i in range(4)]
    keys = [f"prefix {i}".encode() for i in range(4000)]
    first = {k: rendezvous(k, workers)[0] for k in keys}
    assert first == {k: rendezvous(k, list(reversed(workers)))[0] for k in keys}  # order-free
    share = Counter(first.values())
    assert set(share) == set(workers) and min(share.values()) > 0.8 * len(keys) / 4
    # w3 leaves: only its keys move, each to its second choice
    rest = workers[:3]
    for k in keys:
        now = rendezvous(k, rest)[0]
        assert now == first[k] if first[k] != "w3@host" else now == rendezvous(k, workers)[1]
    # a fifth joins: it takes about a fifth of the keys, and only those move
    more = [*workers, "w4@host"]
    moved = [k for k in keys if rendezvous(k, more)[0] != first[k]]
    assert all(rendezvous(k, more)[0] == "w4@host" for k in moved)
    assert 0.15 < len(moved) / len(keys) < 0.25


def test_a_worker_consumes_its_own_queue_first_unless_affinity_is_off():
    from types import SimpleNamespace

    from celery import Celery
    from weightq.settings import Settings
    from weightq.worker.affinity import consume_own_queue

    def queues_of(affinity: str) -> list[str]:
        app = Celery("t", set_as_current=False)
        app.settings = Settings(affinity=affinity == "1")  # what WorkerCelery.configure keeps
        app.conf.task_default_queue = "weightq"
        app.amqp.queues.select(["weightq"])
        consume_own_queue("gpu1@host", SimpleNamespace(app=app))
        return list(app.amqp.queues.consume_from)

    assert queues_of("1") == ["weightq.w.gpu1@host", "weightq"]
    assert queues_of("0") == ["weightq"]


def test_an_own_queue_serves_its_shared_queue_and_a_queue_name_may_not_look_like_one():
    import pytest
    from weightq.settings import Settings
    from weightq.tasks.contract import served_queue, worker_queue

    assert served_queue(worker_queue("weightq", "gpu1@host.example")) == "weightq"
    assert served_queue("weightq") == "weightq"
    with pytest.raises(ValueError, match="QUEUE"):
        Settings.from_env({"QUEUE": "a.w.b"}, env_file=None).check()

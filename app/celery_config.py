"""Celery's configuration, from Settings alone: the same for the worker's app (celery.py) and for
every client's (client/jobs.py), which must not build the worker's app to send a job."""

from __future__ import annotations

import ssl

from .redis_conn import celery_options
from .settings import Settings
from .transport import BROKER_OPTION, BrokerClient


def tls_options(s: Settings, url: str) -> dict:
    """Celery refuses rediss:// without explicit certificate checking: say it for broker and backend."""
    if not url.startswith("rediss://"):
        return {}
    reqs = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
    if s.redis.ssl_cert_reqs not in reqs:
        raise ValueError(f"REDIS_SSL_CERT_REQS={s.redis.ssl_cert_reqs!r}: expected one of {', '.join(reqs)}")
    opts = {"ssl_cert_reqs": reqs[s.redis.ssl_cert_reqs]}
    if s.redis.ssl_ca_certs:
        opts["ssl_ca_certs"] = s.redis.ssl_ca_certs
    return {"broker_use_ssl": opts, "redis_backend_use_ssl": opts}


_OWN_TRANSPORTS = {"redis": "weightq.transport:Transport", "sentinel": "weightq.transport:SentinelTransport"}


def own_transport(url: str) -> bool:
    """Whether Celery reaches this broker URL through weightq's transport (app/transport.py), which
    alone can stage a job (FAIR_QUEUE): rediss:// and unix sockets keep kombu's own."""
    return url.split("://")[0] in _OWN_TRANSPORTS


def celery_config(s: Settings, url: str | None = None) -> dict:
    url = url or s.redis.resolved_url()
    sentinel = celery_options(url, s.redis)
    return {
        "broker_url": url,
        "result_backend": url,
        # JSON only: a pickled (or any foreign) message is refused, never executed.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # At-least-once: a message is acked only when its generation is done.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_pool": "threads",
        "worker_concurrency": s.worker.concurrency,
        "task_default_queue": s.queues.queue,
        "broker_transport_options": {
            "visibility_timeout": s.worker.visibility_timeout_s,
            "unacked_restore_interval": s.worker.restore_interval_s,
            "unacked_restore_throttle": 1,
            # kombu holds this Redis lock while it restores expired messages, 300 s by default: a worker
            # SIGKILLed inside that window stops every worker's restores until the lock expires (a poison
            # job's redelivery waits that long). A restore takes milliseconds, and restoring a tag
            # twice is prevented by kombu's WATCH transaction, so the lock may lapse soon.
            "unacked_mutex_expire": 10,
            # a list per priority (tasks/limits.py: broker_priority), the most urgent taken first
            "priority_steps": list(range(10)),
            "queue_order_strategy": "priority",
            # how the transport reaches the broker outside a channel (app/transport.py: a stale channel's ack)
            BROKER_OPTION: BrokerClient(url, s.redis),
            **sentinel.get("broker_transport_options", {}),
        },
        **({"result_backend_transport_options": sentinel["result_backend_transport_options"]} if sentinel else {}),
        **tls_options(s, url),
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # a Redis restart is waited out, however long
        # kombu's Redis transport without the restore-on-close that crashes the consumer after a
        # Redis crash (see app/transport.py); rediss:// and unix sockets keep kombu's own.
        **({"broker_transport": _OWN_TRANSPORTS[url.split("://")[0]]} if own_transport(url) else {}),
        "result_expires": s.stream.result_ttl_s,
        # The request is kept once, in the job hash (for recovery): an extended result would store it
        # again, with every token id, for RESULT_TTL_S.
        "result_extended": False,
        "task_track_started": False,  # Flower sees "started" through events; skip the extra backend write
        "task_send_sent_event": s.queues.task_events,
        "worker_send_task_events": s.queues.task_events,
        "worker_hijack_root_logger": False,
    }

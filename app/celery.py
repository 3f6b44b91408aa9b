"""The Celery app: `celery -A app worker` finds it here. Configuration comes from Settings alone."""

from __future__ import annotations

from celery import Celery

from .settings import Settings
from .worker import ConsumerLink, EngineStep


def celery_config(s: Settings) -> dict:
    url = s.resolved_redis_url()
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
        "worker_concurrency": s.concurrency,
        "task_default_queue": s.queue,
        "broker_transport_options": {
            "visibility_timeout": s.visibility_timeout_s,
            "unacked_restore_interval": s.restore_interval_s,
            "unacked_restore_throttle": 1,
        },
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # a Redis restart is waited out, however long
        # kombu's Redis transport without the restore-on-close that crashed the consumer after a
        # Redis crash (see app/transport.py); rediss:// and unix sockets keep kombu's own.
        **({"broker_transport": "app.transport:Transport"} if url.startswith("redis://") else {}),
        "result_expires": s.result_ttl_s,
        "result_extended": True,
        "task_track_started": False,  # Flower sees "started" through events; skip the extra backend write
        "task_send_sent_event": s.task_events,
        "worker_send_task_events": s.task_events,
        "worker_hijack_root_logger": False,
    }


app = Celery("weightq", include=["tasks.generate"])
app.config_from_object(celery_config(Settings.from_env()))
app.steps["worker"].add(EngineStep)
app.steps["consumer"].add(ConsumerLink)

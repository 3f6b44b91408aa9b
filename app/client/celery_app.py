"""The client's own Celery app: it sends `weightq.generate` messages and revokes, and is never the
worker's (app/celery.py). Imported when a client sends its first job, so that importing the client
costs no Celery."""

from __future__ import annotations

from celery import Celery
from weightq.celery_config import celery_config
from weightq.settings import Settings


class ClientCelery(Celery):
    """The client's Celery app. Celery's Redis backend subscribes to a task's result channel at every
    send, so that a later .get() cannot miss it: two more commands and a pub/sub message per job, for a
    result weightq's callers read from the stream's end entry. AsyncResult.get() subscribes, then reads
    the stored state, by itself when it is called, so sending skips it."""

    def _get_backend(self):
        backend = super()._get_backend()
        backend.on_task_call = _no_subscription  # the instance only: the backend class stays Celery's
        return backend


def _no_subscription(producer, task_id) -> None:
    return None


def client_celery(settings: Settings, url: str) -> ClientCelery:
    app = ClientCelery("weightq-client")
    app.config_from_object(celery_config(settings, url))
    return app

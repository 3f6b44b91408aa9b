"""The Celery app: `celery -A weightq worker` finds it here. Configuration comes from Settings alone
(celery_config.py).

The worker's bootsteps are named, not imported: they load the engine (torch, the worker extra) when a
worker starts them, so that Flower, `celery inspect` and anything else that imports this app load no
engine.
"""

from __future__ import annotations

from celery import Celery, signals

from .celery_config import celery_config
from .settings import Settings

app = Celery("weightq", include=["weightq.tasks.generate"])
app.config_from_object(celery_config(Settings.from_env()))
app.steps["worker"].add("weightq.worker.boot:EngineStep")
app.steps["consumer"].add("weightq.worker.boot:ConsumerLink")


@signals.celeryd_after_setup.connect
def _own_queue(sender: str, instance, **_kwargs) -> None:
    """Its own queue (prefix affinity), consumed before the shared one; named, like the bootsteps."""
    from .worker.affinity import consume_own_queue

    consume_own_queue(sender, instance)

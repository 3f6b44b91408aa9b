"""The Celery app: `celery -A weightq worker` finds it here. Configuration comes from Settings alone
(celery_config.py).

The worker's bootsteps are named, not imported: they load the engine (torch, the worker extra) when a
worker starts them, so that Flower, `celery inspect` and anything else that imports this app load no
engine.
"""

from __future__ import annotations

import logging

from celery import Celery, signals
from celery.app import backends

from .celery_config import celery_config
from .settings import Settings
from .worker.result_backend import one_trip


class WorkerCelery(Celery):
    """The worker's app: Celery's, with each task's result stored in one round trip
    (app/worker/result_backend.py), and the settings it was configured with, which its bootsteps and
    signal handlers read (they never read the environment themselves)."""

    settings: Settings

    def configure(self, settings: Settings) -> None:
        """Run on `settings`: Celery's configuration from them (celery_config.py), and them for the worker."""
        self.settings = settings
        self.config_from_object(celery_config(settings))

    def _get_backend(self):
        cls, url = backends.by_url(self.backend_cls or self.conf.result_backend, self.loader)
        return one_trip(cls)(app=self, url=url)


app = WorkerCelery("weightq", include=["weightq.tasks.generate"])
app.configure(Settings.from_env())  # `celery -A weightq worker`; `weightq worker` configures it again
app.steps["worker"].add("weightq.worker.boot:EngineStep")
app.steps["consumer"].add("weightq.worker.boot:ConsumerLink")


# the loggers of Celery's per-task lines (a job received, a job done); each checks its level once, at start
TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


@signals.after_setup_logger.connect
def _quiet_task_lines(loglevel: int | str | None = None, **_kwargs) -> None:
    """Two log lines a job are a sixth of a short job's cost in the worker: kept only when TASK_LOGS asks."""
    level = logging.getLevelName(loglevel) if isinstance(loglevel, str) else loglevel
    if app.settings.worker.task_logs or (isinstance(level, int) and level <= logging.DEBUG):
        return
    for name in TASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


@signals.celeryd_after_setup.connect
def _own_queue(sender: str, instance, **_kwargs) -> None:
    """Its own queue (prefix affinity), consumed before the shared one; named, like the bootsteps."""
    from .worker.affinity import consume_own_queue

    consume_own_queue(sender, instance)

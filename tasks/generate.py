"""The `weightq.generate` task: a JSON request in, a JSON result out.

Any app that shares the Redis URL can call it by name (`send_task(TASK_NAME, [request])`, see contract.py).
The task body parses the request (once: a caller by name may send anything), hands the typed request
to the engine hosted by the worker (see app/worker/) and waits.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime

from celery import shared_task
from celery.exceptions import Ignore, Reject
from celery.signals import task_revoked

from .contract import TASK_NAME
from .request import RequestError, parse_request

log = logging.getLogger(__name__)


class NoEngine(RuntimeError):
    """The task ran in a process that hosts no engine."""


class RequestRefused(ValueError):
    """The engine refused the request (the message names the field): the client's error, not the worker's."""


# Expected exceptions: Celery marks the task failed but logs one line, not an error with a traceback.
# Celery reprs every result for its log line and events, whatever the log level, walking it up to
# resultrepr_maxsize characters (Celery's default 1,024 costs the worker CPU on every job, most of it in
# the token ids); the first 160 show the id, the text's start and the finish reason.
@shared_task(name=TASK_NAME, bind=True, throws=(RequestError, RequestRefused), resultrepr_maxsize=160)
def generate(self, request: dict) -> dict:
    host = getattr(self.app, "weightq_host", None)
    if host is None:
        raise NoEngine("this worker hosts no weightq engine: start it with `weightq worker` (threads pool)")
    job_id = self.request.id
    try:
        job = parse_request(request)
    except RequestError as e:
        log.warning("job %s refused: %s", job_id, e)
        host.fail(job_id, e)
        raise
    if job.deadline is None and (expires := _unix(self.request.expires)) is not None:
        job = replace(job, deadline=expires)  # Celery's `expires`: the engine's queue honours it too
    tag = (self.request.delivery_info or {}).get("delivery_tag")
    try:
        return host.run(job_id, job, tag)
    except (Reject, Ignore):
        raise  # back to the queue (warm shutdown), or resumed on another worker: not this run's to end
    except RequestRefused as e:
        log.warning("job %s refused: %s", job_id, e)
        raise
    except Exception as e:
        # Celery acks a failed task: end the job (once) so that no reader waits on it forever
        host.fail_job(job_id, f"{type(e).__name__}: {e}")
        raise


def _unix(expires: object) -> float | None:
    """Celery's `expires` header (ISO 8601 text, or a datetime) in unix seconds."""
    if isinstance(expires, str):
        try:
            expires = datetime.fromisoformat(expires)
        except ValueError:
            return None
    return expires.timestamp() if isinstance(expires, datetime) else None


@task_revoked.connect
def _expired(sender=None, request=None, expired: bool = False, **kwargs) -> None:
    """Celery dropped a message whose `expires` had passed before a worker took it: end its job
    (an error naming `deadline`), so that nobody waits on it and the lost-job sweep never re-sends it."""
    host = getattr(getattr(sender, "app", None), "weightq_host", None)
    if not expired or host is None or getattr(sender, "name", None) != TASK_NAME or request is None:
        return
    host.fail(request.id, RequestError("deadline", "it passed before the job could start (Celery's expires)"))

"""The `weightq.generate` task: a JSON request in, a JSON result out.

Any app that shares the Redis URL can call it by name (`send_task("weightq.generate", [request])`).
The task body hands the request to the engine hosted by the worker (see app/worker.py) and waits.
"""

from __future__ import annotations

from celery import shared_task

from .schema import RequestError, parse_request


class NoEngine(RuntimeError):
    """The task ran in a process that hosts no engine."""


@shared_task(name="weightq.generate", bind=True)
def generate(self, request: dict) -> dict:
    host = getattr(self.app, "weightq_host", None)
    if host is None:
        raise NoEngine("this worker hosts no weightq engine: start it with `weightq worker` (threads pool)")
    try:
        spec = parse_request(request)
    except RequestError as e:
        host.fail(self.request.id, e)
        raise
    tag = (self.request.delivery_info or {}).get("delivery_tag")
    return host.run(self.request.id, spec, tag)

"""weightq's job contract: the request (request.py, with its limits in limits.py), the Redis keys and
stream entries (contract.py, with results.py), and the Celery task (generate.py). It imports nothing
from the engine or the batcher: the web side loads it without torch."""

from .limits import DEFAULT_PRIORITY, MAX_PRIORITY, MIN_PRIORITY, Door
from .request import Guided, JobRequest, Message, RequestError, parse_request

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "Door",
    "Guided",
    "JobRequest",
    "Message",
    "RequestError",
    "parse_request",
]

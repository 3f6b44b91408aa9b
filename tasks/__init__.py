"""weightq's job contract: the Celery task and the request schema."""

from .schema import JobSpec, RequestError, parse_request

__all__ = ["JobSpec", "RequestError", "parse_request"]

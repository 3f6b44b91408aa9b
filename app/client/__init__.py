"""The client SDK: enqueue generations, stream their tokens, run batch files (no engine here)."""

from weightq.redis_conn import RedisUnreachable
from weightq.tasks.contract import JobExpired, JobNotFound, StreamExpired

from .backlog import DeadlineUnreachable, Overloaded
from .jobs import Client, Job, JobFailed, StreamEvent, submit

__all__ = [
    "Client", "DeadlineUnreachable", "Job", "JobExpired", "JobFailed", "JobNotFound", "Overloaded", "RedisUnreachable",
    "StreamEvent", "StreamExpired", "submit",
]  # fmt: skip

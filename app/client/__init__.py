"""The client SDK: enqueue generations, stream their tokens, run batch files (no engine here)."""

from weightq.tasks.contract import JobExpired

from .backlog import DeadlineUnreachable, Overloaded
from .jobs import Client, Job, JobFailed, StreamEvent, submit

__all__ = [
    "Client", "DeadlineUnreachable", "Job", "JobExpired", "JobFailed", "Overloaded", "StreamEvent", "submit",
]  # fmt: skip

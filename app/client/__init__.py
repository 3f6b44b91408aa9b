"""The client SDK: enqueue generations, stream their tokens, run batch files (no engine here)."""

from .jobs import Client, Job, JobFailed, StreamEvent, submit

__all__ = ["Client", "Job", "JobFailed", "StreamEvent", "submit"]

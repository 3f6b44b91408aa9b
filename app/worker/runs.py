"""The worker's book of job runs: what the stream writer and the task threads share about each job
running here, owned by one object that both reach only through its methods."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from weightq.tasks.contract import job_of_stream


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How the writer saw a run end, apart from its FinishEvent."""

    refused: str | None  # why its stream could not be written (it ended with an error entry), or None
    superseded: bool  # a later run of the job began elsewhere: this one's writes were refused


class RunBook:
    """Per job running here: its fence (the attempt its stream writes belong to: WRITE_BATCH refuses
    them once a later run began), the fields added to its result, the event its task waits on until
    its end entry and final state are in Redis, and how the writer saw it end (refused, superseded,
    abandoned by its task). Task threads call begin / end / ended / abandon, the writer thread the
    rest; one lock guards what both change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[str, int] = {}
        self._annotations: dict[str, dict] = {}  # fields added to its result (attempt, worker)
        self._finals: dict[str, threading.Event] = {}
        self._refused: dict[str, str] = {}
        self._superseded: set[str] = set()
        # jobs whose task stopped waiting for their end (Redis down past REDIS_RETRY_S) and ends them
        # itself (FAIL): their entries still queued in the writer are dropped, so a job never ends twice
        self._abandoned: set[str] = set()

    # ----- task threads ------------------------------------------------------------------------
    def begin(self, job_id: str, attempt: int, annotations: dict) -> threading.Event:
        """The run starts: the event is set once its end is written (or its finish was skipped: a job
        going back to the queue). Its task must not finish (be acked) before: a worker killed in between
        would leave a job that no redelivery runs again and no reader sees end."""
        with self._lock:
            self._fences[job_id] = attempt
            self._annotations[job_id] = annotations
            written = self._finals[job_id] = threading.Event()
        return written

    def end(self, job_id: str) -> None:
        """The run left the engine: its fence goes (a batch flushed before keeps the fences it was
        flushed with)."""
        with self._lock:
            self._fences.pop(job_id, None)

    def ended(self, job_id: str) -> RunEnd:
        """How the writer saw the run end; forgotten once asked."""
        with self._lock:
            superseded = job_id in self._superseded
            self._superseded.discard(job_id)
            return RunEnd(self._refused.pop(job_id, None), superseded)

    def abandon(self, job_id: str) -> None:
        """Its task gave up waiting for its end to be written and ends it itself: what of it is still
        queued in the writer is dropped (nothing if its finish was already handled)."""
        with self._lock:
            if job_id in self._finals:
                self._abandoned.add(job_id)
            self._refused.pop(job_id, None)
            self._superseded.discard(job_id)

    # ----- the writer --------------------------------------------------------------------------
    def fences(self) -> dict[str, int]:
        """The fences of now, for a batch flushed now."""
        with self._lock:
            return dict(self._fences)

    def fence(self, job_id: str) -> int | None:
        with self._lock:
            return self._fences.get(job_id)

    def annotations(self, job_id: str) -> dict:
        """The fields its result carries besides the engine's (taken once, by its end entry)."""
        with self._lock:
            return self._annotations.pop(job_id, {})

    def drop_abandoned(self, entries: list[tuple]) -> list[tuple]:
        """A batch's entries less those of abandoned jobs (entries begin with their stream's key)."""
        with self._lock:
            if not self._abandoned:
                return entries
            gone = set(self._abandoned)
        return [e for e in entries if job_of_stream(e[0]) not in gone]

    def refused_jobs(self) -> set[str]:
        """The jobs whose streams were refused for good (a snapshot, once per batch)."""
        with self._lock:
            return set(self._refused)

    def refused(self, job_id: str) -> bool:
        """Whether its stream is closed to this worker: refused for good, or owned by a later run."""
        with self._lock:
            return job_id in self._refused or job_id in self._superseded

    def refuse(self, job_id: str, why: str) -> None:
        with self._lock:
            self._refused[job_id] = why

    def supersede(self, job_id: str) -> bool:
        """True the first time: the caller stops the run."""
        with self._lock:
            if job_id in self._superseded:
                return False
            self._superseded.add(job_id)
            return True

    def written(self, job_id: str) -> None:
        """Its finish was handled by the writer: its task may go on."""
        with self._lock:
            event = self._finals.pop(job_id, None)
            self._abandoned.discard(job_id)
        if event is not None:
            event.set()

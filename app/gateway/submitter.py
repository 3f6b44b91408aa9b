"""Group commit of the gateway's submissions: the requests that arrive while one batch is being written
go together in the next, two Redis round trips for the lot (Client.submit_many).

Submitting one job at a time from a thread pool costs five round trips and a thread hop per job: in a
burst of requests the last would reach its queue long after the engine could have admitted it in its
first step.

A batch takes the pending requests tenant by tenant in turn (each tenant's in order), and holds at most
MAX_BATCH: a request of one tenant waits behind one batch, not behind another tenant's flood of
pending submissions (which would show in the light tenant's TTFT), and a batch is small enough that
waiting behind one costs little.
"""

from __future__ import annotations

import asyncio
import logging

from weightq.client import Client
from weightq.tasks.request import JobRequest

log = logging.getLogger(__name__)


# past a few dozen jobs a batch saves few more round trips per job, and a batch is what another
# tenant's request waits behind: its write takes longer the more jobs it holds, so it stays small
MAX_BATCH = 32


def fair_batch(pending: list, most: int) -> tuple[list, list]:
    """(the next batch, the rest) of `pending` (job, future) pairs: tenants in turn, each in order."""
    queues: dict[str, list] = {}
    for item in pending:
        queues.setdefault(item[0].tenant, []).append(item)
    if len(queues) == 1:
        return pending[:most], pending[most:]
    batch: list = []
    depth = 0
    while len(batch) < most and any(len(q) > depth for q in queues.values()):
        batch += [q[depth] for q in queues.values() if len(q) > depth][: most - len(batch)]
        depth += 1
    taken = {id(item) for item in batch}
    return batch, [item for item in pending if id(item) not in taken]


class Submitter:
    def __init__(self, client: Client, max_batch: int = MAX_BATCH) -> None:
        self.client = client
        self.max_batch = max_batch
        self._pending: list[tuple[JobRequest, asyncio.Future[str]]] = []
        self._writer: asyncio.Task | None = None

    async def submit(self, job: JobRequest) -> str:
        """The job's id once it is recorded and its message published (the route checked the request,
        and the backlog, when it parsed it)."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending.append((job, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        try:
            return await future
        except asyncio.CancelledError:  # cancelled as its id came: nobody will read the job
            if future.done() and not future.cancelled() and future.exception() is None:
                asyncio.get_running_loop().run_in_executor(None, _cancel, [self.client.job(future.result())])
            raise

    async def submit_all(self, jobs: list[JobRequest]) -> list[str]:
        """Every job's id (one group commit where they fit). If one fails, the request fails: the
        others are cancelled, since nobody would read them, and the first error is raised."""
        out = await asyncio.gather(*(self.submit(job) for job in jobs), return_exceptions=True)
        if errors := [e for e in out if isinstance(e, BaseException)]:
            if submitted := [self.client.job(x) for x in out if isinstance(x, str)]:
                asyncio.get_running_loop().run_in_executor(None, _cancel, submitted)
            raise errors[0]
        return [x for x in out if isinstance(x, str)]

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = fair_batch(self._pending, self.max_batch)
            try:
                jobs = await asyncio.to_thread(self.client.submit_many, [r for r, _ in batch], checked=True)
            except Exception as e:  # Redis down beyond REDIS_RETRY_S: every request of the batch fails
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            except BaseException:  # the gateway is stopping
                for _, future in batch:
                    future.cancel()
                raise
            gone = []
            for job, (_, future) in zip(jobs, batch, strict=True):
                if future.done():  # its client went away while the batch was written: nobody will read it
                    gone.append(job)
                else:
                    future.set_result(job.id)
            if gone:
                asyncio.get_running_loop().run_in_executor(None, _cancel, gone)


def _cancel(jobs: list) -> None:
    for job in jobs:
        try:
            job.cancel()
        except Exception:
            log.exception("cancelling job %s, whose client went away, failed", job.id)

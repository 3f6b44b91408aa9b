"""The engine in a spawned process of its own (engine/process/): the same outputs and events as in
process, and the parent and child outliving neither a stop nor each other's death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from weightq.batcher import BatcherConfig
from weightq.engine import (
    Engine,
    EngineConfig,
    EngineProcess,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from weightq.engine.builder import serving_threads
from weightq.engine.model import ModelNotFound
from weightq.engine.process import own_process

CONFIG = EngineConfig(compile="off", batcher=BatcherConfig(max_batch_weight=4096))


def req(rid: str, prompt: str, n: int, **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt=prompt, params=SamplingParams(max_new_tokens=n, **params))


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[object, float]] = []
        self.flushes = 0

    def __call__(self, event, emitted: float) -> None:
        self.events.append((event, emitted))

    def flush(self) -> None:
        self.flushes += 1


@pytest.fixture(scope="module")
def core():
    sink = Sink()
    proc = EngineProcess(CONFIG, sink=sink)
    proc.start()
    proc.test_sink = sink  # type: ignore[attr-defined]
    yield proc
    proc.stop()


def test_outputs_and_event_order_match_the_engine_in_process(core):
    prompts = [f"the engine core {i} says" for i in range(6)]
    requests = [req(f"eq{i}", p, 12 + i) for i, p in enumerate(prompts)]
    handles = [core.submit(r, stream=(i == 0)) for i, r in enumerate(requests)]
    theirs = [h.result(timeout=120) for h in handles]
    ours = Engine(CONFIG).generate([req(f"eq{i}", p, 12 + i) for i, p in enumerate(prompts)])
    assert [(f.token_ids, f.text, f.reason) for f in theirs] == [(f.token_ids, f.text, f.reason) for f in ours]
    streamed = list(handles[0].events(timeout=10))
    assert [e.index for e in streamed[:-1]] == list(range(12)) and isinstance(streamed[-1], FinishEvent)
    assert "".join(e.text for e in streamed[:-1]) == theirs[0].text
    # The sink saw each request's tokens in order, then its finish, with the child's emission stamps.
    for r, final in zip(requests, theirs, strict=True):
        mine = [(e, t) for e, t in core.test_sink.events if e.request_id == r.id]
        assert [e.index for e, _ in mine if isinstance(e, TokenEvent)] == list(range(final.completion_tokens))
        assert isinstance(mine[-1][0], FinishEvent) and all(abs(t - time.time()) < 300 for _, t in mine)
    assert core.test_sink.flushes > 0
    assert core.idle()


class BatchSink(Sink):
    """A sink that takes each step's tokens at once (as the worker's stream publisher does)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[list[tuple], float]] = []

    def tokens(self, tuples: list[tuple], emitted: float) -> None:
        self.steps.append((tuples, emitted))


def test_a_sink_with_tokens_gets_each_steps_tuples_and_streamed_handles_still_every_token():
    sink = BatchSink()
    proc = EngineProcess(CONFIG, sink=sink)
    proc.start()
    try:
        handles = [proc.submit(req(f"bt{i}", f"in batches {i}", 8 + i), stream=(i == 0)) for i in range(3)]
        finals = [h.result(timeout=120) for h in handles]
    finally:
        proc.stop()
    assert all(isinstance(e, FinishEvent) for e, _ in sink.events)  # tokens never come one by one
    for h, final in zip(handles, finals, strict=True):
        mine = [t for step, _ in sink.steps for t in step if t[0] == h.request_id]
        assert [t[1] for t in mine] == list(range(final.completion_tokens))
        assert [t[2] for t in mine] == list(final.token_ids) and "".join(t[3] for t in mine) == final.text
    assert all(abs(emitted - time.time()) < 300 for _, emitted in sink.steps)
    streamed = list(handles[0].events(timeout=10))
    assert [e.index for e in streamed[:-1]] == list(range(8)) and streamed[-1] == finals[0]


def test_refusals_duplicates_and_cancel(core):
    bad = core.submit(req("bad", "x", 0)).result(timeout=30)
    assert bad.reason == "error" and bad.error.startswith("max_new_tokens")
    long = core.submit(req("long", "a long one", 2000, ignore_eos=True), stream=True)
    next(long.events(timeout=60))  # running
    dup = core.submit(req("long", "again", 4)).result(timeout=5)
    assert dup.reason == "error" and "already in flight" in dup.error
    assert core.cancel("long") and not core.cancel("nobody")
    assert long.result(timeout=60).reason == "cancelled"
    deadline = time.monotonic() + 10
    while core.stats().get("running", 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = core.stats()
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0 and stats["engine_pid"] == core.pid
    assert core.room_for() > 0


def test_stop_finishes_what_is_inside_then_the_child_exits():
    sink = Sink()
    proc = EngineProcess(CONFIG, sink=sink)
    proc.start()
    running = proc.submit(req("r", "stopped midway", 1500, ignore_eos=True), stream=True)
    next(running.events(timeout=60))
    proc.stop("cancelled", "worker shutdown")
    final = running.result(timeout=1)  # delivered before stop() returned
    assert (final.reason, final.error) == ("cancelled", "worker shutdown")
    assert any(isinstance(e, FinishEvent) and e.request_id == "r" for e, _ in sink.events)
    assert proc._proc.exitcode == 0
    late = proc.submit(req("late", "x", 2)).result(timeout=1)
    assert late.reason == "error" and "stopped" in late.error


def test_a_dead_child_is_reported_and_fails_what_was_inside():
    deaths: list[str] = []
    proc = EngineProcess(CONFIG, sink=Sink(), on_death=deaths.append)
    proc.start()
    running = proc.submit(req("r", "about to die", 1500, ignore_eos=True), stream=True)
    next(running.events(timeout=60))
    os.kill(proc.pid, signal.SIGKILL)
    final = running.result(timeout=30)
    assert final.reason == "error" and "engine process died" in final.error
    assert deaths and "exit code -9" in deaths[0]


def test_a_start_failure_raises_the_childs_error():
    with pytest.raises(ModelNotFound):
        EngineProcess(EngineConfig(model="/nonexistent/model/dir", allow_download=False))


def test_the_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import time
        from weightq.batcher import BatcherConfig
        from weightq.engine import EngineConfig, EngineProcess
        if __name__ == "__main__":
            proc = EngineProcess(EngineConfig(compile="off", batcher=BatcherConfig(max_batch_weight=4096)))
            proc.start()
            print(proc.pid, flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        child = int(parent.stdout.readline())  # type: ignore[union-attr]
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the engine process outlived its parent by 30 s")
    finally:
        parent.kill()


def test_auto_runs_the_engine_in_its_own_process_where_it_leaves_the_parent_a_core():
    cores = len(os.sched_getaffinity(0))
    assert own_process("on", CONFIG) and not own_process("off", EngineConfig(runner="simulated"))
    assert own_process("auto", EngineConfig(runner="simulated"))
    assert not own_process("auto", EngineConfig(device="cpu"))  # torch's default team: every core
    assert not own_process("auto", EngineConfig(device="cpu", torch_threads=cores))
    assert own_process("auto", EngineConfig(device="cpu", torch_threads=1)) == (cores > 1)


def test_a_serving_engine_leaves_one_core_on_the_cpu():
    """The worker's default (TORCH_THREADS=0): one fewer than torch's default on the CPU, one thread
    on a device; a TORCH_THREADS that is set is kept as it is."""
    default = min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    assert serving_threads(EngineConfig(device="cpu")) == max(1, default - 1)
    assert serving_threads(EngineConfig(device="cpu", torch_threads=3)) == 3
    assert serving_threads(EngineConfig(runner="simulated")) == 1

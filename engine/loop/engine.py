"""The engine: continuous decoding, one step at a time, on its own thread.

submit() and cancel() may be called from any thread; they only queue work (intake.py). The engine
thread drains that queue, asks the batcher for a plan, runs one packed forward pass, samples, and
hands the tokens to the output side (outputs.py: text, events, finishes), whose events go to the
caller's sink and to per-request handles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from weightq.batcher import Batcher, RequestRejected
from weightq.batcher.outlook import Urgency

from ..builder import build, on_fresh_thread
from ..config import EngineConfig
from ..handle import Handle
from ..lora import AdapterControl
from ..model import LoadedModel
from ..params import Event, FinishEvent, FinishReason, GenerationRequest
from ..runner.base import Work
from ..sampling.grammar import Grammars
from ..sampling.sampler import sample
from ..sequence import Sequence
from ..sink import Sink, as_sink
from ..text.detokenizer import TokenTexts
from .deadlines import PASSED, Deadlines
from .intake import Intake, error_event, stopped_event
from .isolate import isolate
from .outputs import StepOutputs
from .prepare import Preparer
from .stats import Meter
from .warmup import warm_up

log = logging.getLogger(__name__)


class Engine:
    """Built from its config (builder.py: backend, model, runner, batcher), composed of the caller
    side (`intake`), the output side (`outputs`) and the counters (`meter`); it owns the running
    sequences and the loop."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        sink: Sink | Callable[[Event], None] | None = None,
        *,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        parts = on_fresh_thread(lambda: build(cfg, loaded))  # see on_fresh_thread: keeps torch fast on our thread
        self.backend, self.lm, self.runner, self.batcher = parts.backend, parts.lm, parts.runner, parts.batcher
        self.kv_derivation, self.max_input_length = parts.kv_derivation, parts.max_input_length
        self.tokenizer = self.lm.tokenizer
        self.token_texts = TokenTexts(self.tokenizer)
        head = self.lm.model.get_output_embeddings()
        self.logits_width = int(head.weight.shape[0]) if head is not None else len(self.tokenizer)
        self.grammars = Grammars(
            self.tokenizer, self.logits_width, self.token_texts,
            timeout_s=cfg.grammar_compile_timeout_s, memory_mb=cfg.grammar_compile_memory_mb,
        )  # fmt: skip
        self.sink = as_sink(sink)
        self.seqs: dict[str, Sequence] = {}
        self.outputs = StepOutputs(self.lm, self.token_texts, self._emit, self._retire, self._finish)
        prepare = Preparer(
            self.lm, cfg.model, self.runner, self.batcher, self.grammars,
            self.logits_width, self.max_input_length, self.outputs.finish_event,
        )  # fmt: skip
        self.intake = Intake(prepare, self.grammars)
        self.meter = Meter()
        self.deadlines = Deadlines()
        self.counters = self.meter.counters
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._generator = torch.Generator().manual_seed(cfg.seed)
        self.adapters = AdapterControl(self.runner.lora, next(self.lm.model.parameters()).dtype, cfg.allow_download)
        # A compiled runner compiles its shapes now, before anyone is served (on a fresh thread: see above).
        self.warmup_s = on_fresh_thread(self._warm_up) if self.runner.compiled else 0.0

    def _warm_up(self) -> float:
        """The warm-up rounds (warmup.py) on the calling thread; the counters start after them."""
        elapsed = warm_up(self.generate, len(self.tokenizer))
        self.meter.reset()
        return elapsed

    # ----- caller side (any thread) ---------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, stream: bool = False) -> Handle:
        """Queue a request. Problems with it never raise here: they finish its handle with an error.
        A grammar not compiled before is compiled on the grammar thread: this returns at once."""
        return self.intake.submit(request, stream)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request; its blocks are free before the next step."""
        return self.intake.cancel(request_id)

    def start(self) -> None:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="weightq-engine", daemon=True)
            self._thread.start()

    def stop(self, reason: FinishReason = "cancelled", message: str | None = None) -> None:
        """Stop the loop; every request still queued or running finishes with `reason`."""
        self._stopping.set()
        self.intake.wake()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.outputs.finish_deferred()
        self._drain()
        for seq in list(self.seqs.values()):
            self._finish(seq, reason, message)
        for rid in self.intake.end_pending():  # requests whose grammar is still compiling end too
            self._emit(stopped_event(rid, reason, message))
        self._flush_sink()

    def generate(self, requests: list[GenerationRequest]) -> list[FinishEvent]:
        """Run requests to completion on the calling thread (offline use; the loop must not run)."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the engine on the calling thread: stop() the loop first")
        handles = [self.submit(r) for r in requests]
        intake = self.intake
        while any(h.final is None for h in handles):
            idle = not self.step() and not intake.queued()
            if idle and intake.pending:  # a grammar compiling on the grammar thread
                intake.wait_prepared(0.05)
            elif idle and any(h.final is None for h in handles):  # a refused request finishes in the idle step
                raise RuntimeError("engine idle with unfinished requests")
        return [h.final for h in handles]  # type: ignore[misc]

    def idle(self) -> bool:
        """Nothing running, waiting or submitted (and every event out)."""
        b, intake = self.batcher, self.intake
        return not b.running and not b.waiting and not intake.inbox and not self.outputs.deferred and not intake.pending

    def reset_prefix_cache(self) -> int:
        """Drop the cached prompt blocks no request holds (benchmarks' cold starts); returns how many."""
        ledger = self.batcher.ledger
        return ledger.drop_cache() if ledger is not None else 0

    def load_adapter(self, name: str, path: str) -> None:
        self.adapters.load(name, path)  # engine/lora/control.py

    def unload_adapter(self, name: str) -> bool:
        return self.adapters.unload(name)

    def room_for(self) -> int:
        """How many more typical requests a worker may take now (Batcher.room_for)."""
        return self.batcher.room_for()

    def urgency(self) -> Urgency:
        """What a worker takes beyond its room: Batcher.urgency."""
        return self.batcher.urgency()

    def stats(self) -> dict:
        b, meter = self.batcher, self.meter
        st = b.stats
        return {
            "running": len(b.running),
            "waiting": len(b.waiting),
            "urgency": asdict(b.urgency()),  # what a worker takes beyond its room (app/worker/intake.py)
            "batch_weight": b.batch_weight(),
            "max_batch_weight": b.budget,
            "max_input_length": self.max_input_length,
            "max_total_tokens": b.config.max_total_tokens,
            **self.runner.memory(),
            **meter.rates(),
            **{k: (round(v, 3) if isinstance(v, float) else v) for k, v in meter.counters.items()},
            "occupied_s": round(meter.occupied_s(), 3),
            "model": self.config.model,
            "structured": self.grammars.available,  # can serve `guided` (xgrammar installed)
            "lora": self.runner.lora is not None,  # serves LoRA adapters (loaded at run time too)
            "adapters": self.runner.lora.adapters if self.runner.lora is not None else [],  # LoRA, by name
            "adapter_errors": dict(self.adapters.errors),  # run-time loads that failed, and why
            "attention": self.backend,
            "runner": self.lm.runner,
            "compiled": self.runner.compiled,
            "warmup_s": round(self.warmup_s, 1),
            "mode": b.config.mode,
            "prefix_cache": bool(b.ledger is not None and b.ledger.caching),
            "prefix_hit_rate": round(st.cached_tokens / st.prompt_tokens, 4) if st.prompt_tokens else 0.0,
            "prefix_cached_tokens": st.cached_tokens,
            "prefix_shared_blocks": b.shared_blocks_held,
            "outlook": b.outlook(),  # for the web side's projected waits (app/client/backlog.py)
        }

    def use_batcher(self, batcher: Batcher) -> None:
        """Another admission policy on the same engine (benchmarks' baselines); requests are checked
        against it from now on."""
        self.batcher = batcher
        self.intake.prepare = replace(self.intake.prepare, batcher=batcher)

    # ----- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                worked = self.step()
            except Exception as e:  # a failed step fails its requests, never the loop
                log.exception("engine step failed")
                for seq in list(self.seqs.values()):
                    if seq.sched.id in self.batcher.running:
                        self._finish(seq, "error", f"engine step failed: {e!r}")
                continue
            if not worked:
                self.intake.wait(self._stopping, 0.05)

    def step(self) -> bool:
        """One scheduling decision and one forward pass; False when there was nothing to run.
        The sink is flushed after every step (one write batch per step), and on an asynchronous
        device also once the previous step's events are out, mid-step."""
        try:
            return self._step()
        finally:
            self.meter.occupancy(bool(self.seqs), time.perf_counter())
            self._flush_sink()

    def _flush_sink(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    def _step(self) -> bool:
        t_start = time.perf_counter()
        self._drain()
        self.meter.occupancy(bool(self.seqs), t_start)
        now = time.monotonic()
        plan = self.batcher.schedule(now)
        runner, outputs, seqs = self.runner, self.outputs, self.seqs
        self.adapters.apply(self.batcher)  # LoRA: the slots' adapters in place before the forward
        for req in plan.preempted:
            runner.release(seqs[req.id])
        if not plan:
            outputs.finish_deferred()
            return False
        for req in plan.admitted:
            seq = seqs[req.id]
            if not seq.admitted_s:
                seq.admitted_s = now
        prefill: list[Work] = []
        for req, n in plan.prefill:
            seq = seqs[req.id]
            runner.ensure(seq, req.prefilled + n)
            prefill.append(Work(seq, req.prefilled, n, req.prefilled + n == req.context_len))
        decode: list[Work] = []
        for req in plan.decode:
            seq = seqs[req.id]
            runner.ensure(seq, req.prefilled + 1)
            decode.append(Work(seq, req.prefilled, 1, True))
        model_before = runner.model_s
        try:
            logits = runner.forward(prefill, decode)
        except Exception as e:
            logits = isolate(runner, self.batcher, self._finish, prefill, decode, e)
        if outputs.deferred:
            # The last step's text and events, while an asynchronous device computes, and out at once:
            # held to the end of this step they would wait a whole step more (their emit stamp hides it).
            outputs.finish_deferred()
            self._flush_sink()
        runner.synchronize()
        failed = outputs.prompt_logprobs(runner.prompt_rows) if runner.prompt_logprobs and runner.prompt_rows else {}
        fwd = runner.model_s - model_before
        emitted = [seqs[r.id] for r in self.batcher.complete(plan)]
        tokens, rows = sample(logits, emitted, self._generator, self.lm.eos_token_ids) if emitted else ([], None)
        emitted, tokens, rows = outputs.drop_failed(seqs, emitted, tokens, rows, failed)
        lps = outputs.logprobs(tokens, rows) if rows is not None else [None] * len(tokens)
        done = time.monotonic()
        if runner.asynchronous:
            outputs.defer(emitted, tokens, done, lps)
        else:
            outputs.accept_all(emitted, tokens, done, lps)
        if self.batcher.batch_weight() > self.batcher.budget:
            self.counters["overflow_steps"] += 1
        self.meter.count(plan.prefill_tokens, len(plan.decode), fwd, time.perf_counter() - t_start)
        if self.config.check_invariants:
            self._check_invariants()
        return True

    def _check_invariants(self) -> None:
        """Tests (check_invariants): the KV pool and the budget agree with the batcher after every step."""
        b = self.batcher
        assert b.batch_weight() <= b.budget, "batch weight over budget"
        b.check_memory()
        self.runner.check(list(self.seqs.values()), b.budget)
        for seq in self.seqs.values():
            assert len(seq.token_ids) == seq.sched.context_len, f"{seq.id}: tokens out of step with the batcher"

    def _drain(self) -> None:
        items, cancels = self.intake.take()
        for item in items:
            if isinstance(item, FinishEvent):
                self._emit(item)
                continue
            try:
                self.batcher.submit(item.sched)
            except RequestRejected as e:
                self._emit(error_event(item.id, str(e), item.prompt_len, item.submitted_s))
                continue
            self.seqs[item.id] = item
            self.deadlines.track(item)
        for rid in cancels:
            seq = self.seqs.get(rid)
            if seq is not None:
                self._finish(seq, "cancelled")
        for seq in self.deadlines.expired(self.seqs):
            self._finish(seq, "error", PASSED)

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self.outputs.finish_deferred()  # its earlier tokens' events go first
        self._retire(seq, reason)
        self._emit(self.outputs.finish_event(seq, reason, error))

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """The request leaves the batcher and its blocks go back to the pool."""
        rid = seq.id
        if rid in self.batcher.running and reason in ("eos", "stop", "length"):
            self.batcher.finish(rid)
        else:
            self.batcher.cancel(rid)
        self.runner.release(seq)
        del self.seqs[rid]
        self.counters["finished"] += 1

    def _emit(self, event: Event) -> None:
        if self.sink is not None:
            try:
                self.sink(event)
            except Exception:
                log.exception("event sink failed for %s", event.request_id)
        handle = self.intake.handle_of(event)
        if handle is not None:
            handle._put(event)

"""The engine: continuous decoding, one step at a time, on its own thread.

submit() and cancel() may be called from any thread; they only queue work. The engine thread
drains that queue, asks the batcher for a plan, runs one packed forward pass, samples, detokenizes
and reports events (token, finish) to the caller's sink and to per-request handles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from weightq.batcher import Request, RequestRejected, chain_keys

from .builder import build, on_fresh_thread
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, StopMatcher, TokenTexts
from .grammar import Grammars
from .handle import Handle
from .model import LoadedModel
from .outputs import Deferred, StepOutputs, replay
from .params import (
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
)
from .prompt import prompt_ids, render_chat
from .runner.base import Work
from .sampling import sample
from .sequence import Sequence
from .sink import Sink, as_sink
from .stats import EngineStats
from .warmup import warm_up

log = logging.getLogger(__name__)


class Engine(StepOutputs, EngineStats):
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
            timeout_s=cfg.grammar_timeout_s, memory_mb=cfg.grammar_memory_mb,
        )  # fmt: skip
        # One thread compiles grammars not compiled before, so a slow compile never holds up a submit
        # or a cancel (the engine process's command thread, a task thread) or the loop.
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="weightq-grammar")
        self._pending: set[str] = set()  # submitted, not yet in the inbox (being prepared)
        self._cancelled_pending: set[str] = set()  # ... and cancelled, or finished by stop()
        self.sink = as_sink(sink)
        self.seqs: dict[str, Sequence] = {}
        self._handles: dict[str, Handle] = {}
        self._inbox: deque[Sequence | FinishEvent] = deque()
        self._cancels: deque[str] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._generator = torch.Generator().manual_seed(cfg.seed)
        # An asynchronous device's step leaves its text and events here, done during the next forward.
        self._deferred: list[list[Deferred]] = []
        self._init_counters()
        # A compiled runner compiles its shapes now, before anyone is served (on a fresh thread: see above).
        self.warmup_s = on_fresh_thread(lambda: warm_up(self)) if self.runner.compiled else 0.0

    # ----- caller side (any thread) ---------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, stream: bool = False) -> Handle:
        """Queue a request. Problems with it never raise here: they finish its handle with an error.
        A grammar not compiled before is compiled on the grammar thread: this returns at once."""
        handle = Handle(request.id, stream)
        now = time.monotonic()
        guided = request.params.guided
        with self._cv:
            if request.id in self._handles:
                handle._put(
                    self._error_event(request.id, f"id: request id {request.id!r} is already in flight", 0, now)
                )
                return handle
            self._handles[request.id] = handle
            self._pending.add(request.id)
        if guided is not None and not self.grammars.ready(guided):
            self._grammar_thread.submit(self._enqueue, request, now)
        else:
            self._enqueue(request, now)
        return handle

    def _enqueue(self, request: GenerationRequest, now: float) -> None:
        try:
            item: Sequence | FinishEvent = self._prepare(request, now)
        except (InvalidRequest, RequestRejected) as e:
            item = self._error_event(request.id, str(e), 0, now)
        except Exception as e:  # a bug preparing it (on the grammar thread: nobody else would hear of it)
            log.exception("preparing request %s failed", request.id)
            item = self._error_event(request.id, f"the engine could not prepare this request: {e!r:.300}", 0, now)
        with self._cv:
            self._pending.discard(request.id)
            if request.id in self._cancelled_pending:  # cancelled (or stopped) while it was prepared
                self._cancelled_pending.discard(request.id)
                if self._handles.get(request.id) is None:
                    return  # stop() finished it
                item = FinishEvent(request.id, "cancelled", "", (), 0, 0, 0.0, 0.0, time.monotonic() - now)
            self._inbox.append(item)
            self._cv.notify()

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request; its blocks are free before the next step."""
        with self._cv:
            known = request_id in self._handles
            if request_id in self._pending:
                self._cancelled_pending.add(request_id)
            elif known:
                self._cancels.append(request_id)
                self._cv.notify()
        return known

    def start(self) -> None:
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="weightq-engine", daemon=True)
            self._thread.start()

    def stop(self, reason: FinishReason = "cancelled", message: str | None = None) -> None:
        """Stop the loop; every request still queued or running finishes with `reason`."""
        self._stopping.set()
        with self._cv:
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._finish_deferred()
        self._drain()
        for seq in list(self.seqs.values()):
            self._finish(seq, reason, message)
        with self._cv:  # requests whose grammar is still compiling end too (their compile is dropped)
            pending = [rid for rid in self._pending if rid not in self._cancelled_pending]
            self._cancelled_pending.update(pending)
        for rid in pending:
            self._emit(FinishEvent(rid, reason, "", (), 0, 0, 0.0, 0.0, 0.0, message))
        self._flush_sink()

    def generate(self, requests: list[GenerationRequest]) -> list[FinishEvent]:
        """Run requests to completion on the calling thread (offline use; the loop must not run)."""
        if self._thread is not None:
            raise RuntimeError("generate() runs the engine on the calling thread: stop() the loop first")
        handles = [self.submit(r) for r in requests]
        while any(h.final is None for h in handles):
            idle = not self.step() and not self._inbox and not self._cancels
            if idle and self._pending:  # a grammar compiling on the grammar thread
                with self._cv:
                    self._cv.wait_for(lambda: self._inbox or not self._pending, 0.05)
            elif idle and any(h.final is None for h in handles):  # a refused request finishes in the idle step
                raise RuntimeError("engine idle with unfinished requests")
        return [h.final for h in handles]  # type: ignore[misc]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a chat: the tokenizer's chat template with the assistant's turn opened."""
        return render_chat(self.tokenizer, self.config.model, messages)

    def idle(self) -> bool:
        """Nothing running, waiting or submitted (and every event out)."""
        b = self.batcher
        return not b.running and not b.waiting and not self._inbox and not self._deferred and not self._pending

    def reset_prefix_cache(self) -> int:
        """Drop the cached prompt blocks no request holds (benchmarks' cold starts); returns how many."""
        ledger = self.batcher.ledger
        return ledger.drop_cache() if ledger is not None else 0

    def room_for(self) -> int:
        """How many more typical requests a worker may take now (Batcher.room_for)."""
        return self.batcher.room_for()

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
                with self._cv:
                    if not self._inbox and not self._cancels and not self._stopping.is_set():
                        self._cv.wait(0.05)

    def step(self) -> bool:
        """One scheduling decision and one forward pass; False when there was nothing to run.
        The sink is flushed after every step (one write batch per step), and
        on an asynchronous device also once the previous step's events are out, mid-step."""
        try:
            return self._step()
        finally:
            self._occupancy(time.perf_counter())
            self._flush_sink()

    def _flush_sink(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    def _step(self) -> bool:
        t_start = time.perf_counter()
        self._drain()
        self._occupancy(t_start)
        now = time.monotonic()
        plan = self.batcher.schedule(now)
        runner = self.runner
        for req in plan.preempted:
            runner.release(self.seqs[req.id])
        if not plan:
            self._finish_deferred()
            return False
        seqs = self.seqs
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
        model_before = self.runner.model_s
        try:
            logits = runner.forward(prefill, decode)
        except Exception as e:
            logits = self._isolate(prefill, decode, e)
        if self._deferred:
            # The last step's text and events, while an asynchronous device computes, and out at once:
            # held to the end of this step they waited a whole step more (their emit stamp hid it).
            self._finish_deferred()
            self._flush_sink()
        runner.synchronize()
        failed = self._prompt_logprobs(runner.prompt_rows) if runner.prompt_logprobs and runner.prompt_rows else {}
        fwd = self.runner.model_s - model_before
        emitted = [seqs[r.id] for r in self.batcher.complete(plan)]
        tokens, rows = sample(logits, emitted, self._generator, self.lm.eos_token_ids) if emitted else ([], None)
        emitted, tokens, rows = self._drop_failed(emitted, tokens, rows, failed)
        lps = self._logprobs(tokens, rows) if rows is not None else [None] * len(tokens)
        done = time.monotonic()
        if runner.asynchronous:
            self._defer(emitted, tokens, done, lps)
        else:
            self._accept_all(emitted, tokens, done, lps)
        if self.batcher.batch_weight() > self.batcher.budget:
            self.counters["overflow_steps"] += 1
        self._count(plan.prefill_tokens, len(plan.decode), fwd, time.perf_counter() - t_start)
        if self.config.check_invariants:
            self._check_invariants()
        return True

    def _drop_failed(self, emitted: list[Sequence], tokens: list[int], rows: list | None, failed: dict) -> tuple:
        """After sampling: each guided sequence's matcher takes its token before the next step fills
        its mask, and one whose token the grammar does not take (its mask left nothing to draw) fails,
        never going on with text outside the grammar; the sequences in `failed` (id -> why: their
        prompt log-probabilities) fail too. Failures end with an error; returns the step's
        (sequences, tokens, logprob rows) that go on."""
        for seq, tok in zip(emitted, tokens, strict=True):
            if seq.grammar is not None and not seq.grammar.accept(tok):
                failed[seq.id] = "guided: the grammar cannot go on with any token of this model's vocabulary"
        if not failed:
            return emitted, tokens, rows
        for rid, message in failed.items():
            if rid in self.seqs:
                self._finish(self.seqs[rid], "error", message)
        keep = [i for i, seq in enumerate(emitted) if seq.id not in failed]
        return [emitted[i] for i in keep], [tokens[i] for i in keep], None if rows is None else [rows[i] for i in keep]

    def _prepare(self, request: GenerationRequest, now: float) -> Sequence | FinishEvent:
        params = request.params
        ids = prompt_ids(self.tokenizer, self.config.model, request)
        if not ids:
            raise InvalidRequest("prompt", "must not be empty")
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequest("stop_token_ids", f"every id must be an integer in [0, {vocab})")
        if params.prompt_logprobs is not None and not self.runner.prompt_logprobs:
            raise InvalidRequest("prompt_logprobs", f"not available on the {self.lm.runner} runner")
        if any(t >= self.logits_width for t, _ in params.logit_bias):
            raise InvalidRequest("logit_bias", f"every key must be a token id in [0, {self.logits_width})")
        if len(ids) > self.max_input_length:
            raise InvalidRequest("prompt", f"{len(ids)} tokens exceeds max_input_length {self.max_input_length}")
        # An encoder-decoder's input is its encoder's: padded on its own, the batcher's fixed part.
        fixed = len(ids) if self.lm.seq2seq else 0
        # None: until the context limit, as OpenAI's chat API runs (predictive admission reserves
        # the expected length, not all of it)
        max_new = params.max_new_tokens
        if max_new is None:
            max_new = self.batcher.config.max_total_tokens - len(ids)
        sched = Request(
            request.id,
            len(ids),
            max_new,
            arrival_s=now,
            fixed_len=fixed,
            priority=request.priority,
            tenant=request.tenant,
        )
        sched.runs_to_max = params.ignore_eos and not params.stop and not params.stop_token_ids
        ledger = self.batcher.ledger
        if ledger is not None and ledger.caching and params.prompt_logprobs is None:
            # prompt log-probabilities need every prompt position's logits: computed, never cached
            sched.prefix = chain_keys(ids, ledger.block_size, request.cache_salt.encode())
        self.batcher.check(sched)
        seq = Sequence(
            request, sched, ids, len(ids), IncrementalDetokenizer(self.tokenizer), StopMatcher(params.stop), now
        )
        if params.guided is not None:
            seq.grammar = self.grammars.guide(params.guided)  # compiled here, on the caller's thread
        if request.emitted:
            if any(not 0 <= t < self.logits_width for t in request.emitted):
                raise InvalidRequest("emitted", f"every id must be a token id in [0, {self.logits_width})")
            ended = replay(seq, request.emitted, request.emitted_logprobs, self.lm.eos_token_ids)
            if ended is not None:
                return self._finish_event(seq, ended)
        return seq

    def _drain(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
            cancels = list(self._cancels)
            self._cancels.clear()
        for item in items:
            if isinstance(item, FinishEvent):
                self._emit(item)
                continue
            try:
                self.batcher.submit(item.sched)
            except RequestRejected as e:
                self._emit(self._error_event(item.id, str(e), item.prompt_len, item.submitted_s))
                continue
            self.seqs[item.id] = item
        for rid in cancels:
            seq = self.seqs.get(rid)
            if seq is not None:
                self._finish(seq, "cancelled")

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        self._finish_deferred()  # its earlier tokens' events go first
        self._retire(seq, reason)
        self._emit(self._finish_event(seq, reason, error))

    def _retire(self, seq: Sequence, reason: FinishReason) -> None:
        """The request leaves the batcher and its blocks go back to the pool."""
        rid = seq.id
        if rid in self.batcher.running:
            if reason in ("eos", "stop", "length"):
                self.batcher.finish(rid)
            else:
                self.batcher.cancel(rid)
        else:
            self.batcher.cancel(rid)
        self.runner.release(seq)
        del self.seqs[rid]
        self.counters["finished"] += 1

    def _isolate(self, prefill: list[Work], decode: list[Work], error: Exception) -> torch.Tensor:
        """The packed forward failed: run each sequence's work alone, fail the ones that still fail
        (their blocks go back to the pool) and return the others' logits in the packed order, so one
        bad request never takes the batch down. Rerunning rewrites the same KV slots with the same values.
        Prefix cache: the blocks a failed request was to write this step leave the cache (their KV was
        never written), and a request admitted onto them in the same step fails with it."""
        if not self.runner.can_isolate:  # the padded runner: one batch, one fate
            log.warning("forward over %d sequences failed (%r)", len(prefill) + len(decode), error)
            for work in prefill + decode:
                self._finish(work.seq, "error", f"the model failed on this step: {error!r}")
            return torch.empty(0, 0)
        log.warning("forward over %d sequences failed (%r); isolating", len(prefill) + len(decode), error)
        rows: list[torch.Tensor] = []
        unwritten: set[int] = set()  # blocks whose KV a failed request was to write this step
        ledger, span = self.batcher.ledger, self.batcher.weight.block_size
        for work, alone in [(w, ([w], [])) for w in prefill] + [(w, ([], [w])) for w in decode]:
            if alone[0] and work.start and work.seq.sched.rings:
                # its chunk's last window may be in part of the ring already, over the prefix it reads:
                # prefilled again from the start (or the prefix cache), not rerun
                self.batcher.requeue(work.seq.id)
                self.runner.release(work.seq)
                continue
            reads = work.seq.block_table[: -(-work.start // span)]
            if unwritten.intersection(reads):
                self._finish(
                    work.seq, "error", f"the model failed on a cached prompt prefix this request shares: {error!r}"
                )
                continue
            try:
                out = self.runner.forward(*alone)
            except Exception as e:
                log.warning("request %s fails the forward pass: %r", work.seq.id, e)
                if ledger is not None:
                    written = work.seq.block_table[work.start // span : -(-(work.start + work.n) // span)]
                    unwritten.update(written)
                    ledger.forget(written)
                self._finish(work.seq, "error", f"the model failed on this request: {e!r}")
                continue
            if work.emits:
                rows.append(out)
        if not rows:
            return torch.empty(0, 0)
        return torch.cat(rows)

    def _error_event(self, rid: str, message: str, prompt_tokens: int, since: float) -> FinishEvent:
        return FinishEvent(rid, "error", "", (), prompt_tokens, 0, 0.0, 0.0, time.monotonic() - since, message)

    def _emit(self, event: Event) -> None:
        if self.sink is not None:
            try:
                self.sink(event)
            except Exception:
                log.exception("event sink failed for %s", event.request_id)
        if isinstance(event, FinishEvent):
            with self._cv:
                handle = self._handles.pop(event.request_id, None)
        else:
            handle = self._handles.get(event.request_id)
        if handle is not None:
            handle._put(event)

"""A simulated device: a measuring tool, never a serving mode (RUNNER=simulated).

Everything around the forward pass is real: the batcher, KV block allocation (a real block table and
free list, over a pool of one float per token), sampling on a vocabulary-sized logits tensor,
detokenization with the model's tokenizer, events, streams and Celery. The forward pass becomes a
wait of the modelled device time (the step cost model of `weightq sim`: by default roughly a 7B model
on one A100-class GPU; SIM_STEP_COST="fixed,per_token,per_kv" to change it) that releases the GIL, as
a GPU kernel launch and synchronise do, and a deterministic token choice.

What it answers: how busy would the device be, and what does the Python around it cost, with the
cores free of the model as on a GPU machine (bench.serve --runner simulated). Outputs are not text
anyone wants.
"""

from __future__ import annotations

import time

import torch
from weightq.batcher.sim.cost import StepCost

from .base import PagedMemory, Work
from .kv_cache import KVCache, KVGeometry

# One float per token: the allocator is the paged runner's, the memory behind it is negligible.
SIMULATED_GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


class SimulatedRunner(PagedMemory):
    compiled = False
    can_isolate = True
    asynchronous = True  # as a GPU: forward() returns at once, synchronize() waits out the device time

    def __init__(self, cache: KVCache, vocab_size: int, cost: StepCost, avoid: frozenset[int] = frozenset()) -> None:
        self.cache = cache
        self.vocab_size = vocab_size
        self.cost = cost
        self.avoid = avoid  # token ids never chosen (EOS): outputs run to max_new_tokens, as a benchmark wants
        self.model_s = 0.0  # modelled device seconds (device busy = model_s / wall time)
        self._ready = 0.0  # perf_counter time at which the last forward's device work ends

    def forward(self, prefill: list[Work], decode: list[Work]) -> torch.Tensor:
        works = prefill + decode
        tokens = sum(w.n for w in works)
        kv_tokens = sum(w.start + w.n for w in works)
        device_s = self.cost(tokens, kv_tokens)
        t0 = time.perf_counter()
        emitting = [w for w in prefill if w.emits] + decode
        logits = torch.zeros(len(emitting), self.vocab_size)
        if emitting:
            choice = torch.tensor([self._next_token(w) for w in emitting])
            logits[torch.arange(len(emitting)), choice] = 1.0
        # The device starts when its inputs are ready; building the logits above counts as host time
        # (on a GPU the sampler's logits are the device's, here they stand in for them).
        self._ready = max(t0, self._ready) + device_s
        self.model_s += device_s
        return logits

    def synchronize(self) -> None:
        remaining = self._ready - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _next_token(self, w: Work) -> int:
        """A function of the sequence's last token and position: the same request gives the same output."""
        pos = w.start + w.n - 1
        tok = (w.seq.token_ids[pos] * 7919 + pos * 104729 + 17) % self.vocab_size
        while tok in self.avoid:
            tok = (tok + 1) % self.vocab_size
        return tok

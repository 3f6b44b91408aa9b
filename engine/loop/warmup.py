"""Compile before serving: run the shapes a compiled runner will meet, so no request pays for it.

torch.compile builds a graph per shape class it specialises on (the paged runner's token counts are
unbacked: one graph, unless a model needs backed ones): steps of one token or several, decode groups
of one row or several, contexts of one KV block or several. A few tiny requests cover them all; the
engine runs them before it reports ready (the worker starts consuming only after), and logs the time
and how many graphs came from the on-disk compile cache (a warm start traces, but compiles nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch._dynamo.utils import counters

from ..params import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

# (prompt tokens, new tokens) per request, in rounds that run one after the other.
ROUNDS = (
    ((8, 12), (40, 4), (4, 3), (5, 3)),  # several rows over several blocks, then one row alone (1 and 2+ blocks)
    ((4, 3), (6, 3)),  # several rows within one block
    ((6, 2),),  # a prompt alone: several tokens, one logits row
)


def warm_up(generate: Callable[[list[GenerationRequest]], Any], vocab: int) -> float:
    """Run the warm-up rounds through `generate` (the engine's, on the calling thread) with token ids
    below `vocab`; returns the seconds it took."""
    found, compiled = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    t0 = time.perf_counter()
    for r, round_ in enumerate(ROUNDS):
        generate(
            [
                GenerationRequest(
                    f"warmup-{r}-{i}",
                    prompt_token_ids=[(7 * i + j) % vocab for j in range(prompt)],
                    params=SamplingParams(max_new_tokens=new, ignore_eos=True),
                )
                for i, (prompt, new) in enumerate(round_)
            ]
        )
    elapsed = time.perf_counter() - t0
    found = counters["inductor"]["fxgraph_cache_hit"] - found
    compiled = counters["inductor"]["fxgraph_cache_miss"] - compiled
    log.info("compiled and warmed up in %.1f s (compile cache: %d graphs found, %d compiled)", elapsed, found, compiled)
    return elapsed

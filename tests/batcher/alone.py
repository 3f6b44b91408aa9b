"""A batcher alone, as these tests state it: what the engine would fill in (the context, the block size)
given, and the batcher's own choices made plain (worst case, no prefill cap, no prefix cache) unless a
test varies them, so that each test names only what it is about."""

from weightq.batcher import BatcherConfig

ALONE = {
    "max_total_tokens": 2048,
    "block_size": 1,
    "max_prefill_weight": 0,
    "mode": "worst_case",
    "prefix_cache": False,
}


def alone(**options) -> BatcherConfig:
    return BatcherConfig(**(ALONE | options))

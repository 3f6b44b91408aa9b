"""Other decoder families through the same paged attention: tiny random models built locally."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from weightq.engine import Engine, EngineConfig

from tests.reference import assert_greedy_equal, mixed_requests

SMALL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)
FAMILIES = {
    "gpt2": lambda v: GPT2Config(vocab_size=v, n_positions=512, n_embd=128, n_layer=2, n_head=4, initializer_range=0.1),
    "mistral": lambda v: MistralConfig(vocab_size=v, sliding_window=None, **SMALL),
    "qwen2": lambda v: Qwen2Config(vocab_size=v, **SMALL),
    "qwen3": lambda v: Qwen3Config(vocab_size=v, head_dim=32, **SMALL),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_dir(request, tmp_path_factory, tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    config = FAMILIES[request.param](len(tok))
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_family_greedy_matches_generate(family_dir):
    reference = AutoModelForCausalLM.from_pretrained(family_dir, attn_implementation="sdpa").eval()
    engine = Engine(
        EngineConfig(
            model=str(family_dir),
            device="cpu",
            max_batch_weight=1024,
            max_total_tokens=320,
            max_prefill_weight=64,
            check_invariants=True,
        )
    )
    reqs = mixed_requests(10, seed=3, max_prompt=200, max_new=60)
    results = engine.generate(reqs)
    assert_greedy_equal(reference, reqs, results)
    assert engine.batcher.ledger.used == 0

"""The models the device check builds: random Llamas of a known shape, saved with the built-in
tokenizer so the engine loads them by path (nothing can be downloaded on the device machine)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from weightq.engine.model import builtin_path

COMMON = {"vocab_size": 32000, "max_position_embeddings": 2048, "initializer_range": 0.1, "tie_word_embeddings": False}
TINYLLAMA = {  # TinyLlama-1.1B's shape: 1.10B parameters with COMMON's vocabulary
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
}
MID = {  # 56M: exact float32 equality at a realistic head_dim and vocabulary, quickly
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
TINY = {
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def build_random_llama(out: Path, shape: dict, dtype: torch.dtype, device: torch.device, seed: int) -> int:
    """A seeded random Llama saved with the built-in tokenizer, for the engine to load by path.

    The tokenizer's vocabulary (~1.1k) is smaller than the model's (32k): prompts are given as ids
    below it, and the detokenizer drops ids it does not know, which is all a benchmark needs."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(builtin_path("tiny"))
    config = LlamaConfig(
        **COMMON, **shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    torch.manual_seed(seed)
    try:
        with device:  # initialise where it will run: 1.1B parameters take seconds on a GPU
            model = LlamaForCausalLM(config)
    except Exception as e:  # not seen; slower on the CPU, but the check goes on
        print(f"device_check: building on {device} failed ({e}); building on the CPU", file=sys.stderr)
        free_memory()
        model = LlamaForCausalLM(config)
    model.to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory()
    return params


def load_reference(path: Path, dtype: torch.dtype, device: torch.device):
    """transformers' own model (its SDPA attention): what our engine must agree with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    model.generation_config.eos_token_id = None  # else generate() merges it back and stops at EOS
    return model


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shape_text(shape: dict) -> str:
    return (
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']} heads, "
        f"{shape['num_key_value_heads']} KV heads, vocab {COMMON['vocab_size']}"
    )

"""Tiny random models of every family weightq claims (docs/models.md: Model families), built from transformers'
own config classes: windows smaller than the prompts the tests send, so every variant bites."""

from __future__ import annotations

from collections.abc import Callable

import transformers as T

WINDOW = 48  # smaller than the prompts (up to 160 tokens) and than max_total_tokens
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)
HEAD = dict(SMALL, head_dim=16)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (config for a vocabulary of v tokens, the runner that serves it)
FAMILIES: dict[str, tuple[Callable[[int], object], str]] = {
    "llama3": (lambda v: T.LlamaConfig(vocab_size=v, rope_parameters=LLAMA3_ROPE, **SMALL), "paged"),
    "qwen3": (lambda v: T.Qwen3Config(vocab_size=v, **HEAD), "paged"),
    "gemma": (lambda v: T.GemmaConfig(vocab_size=v, **HEAD), "paged"),
    "phi3": (lambda v: T.Phi3Config(vocab_size=v, sliding_window=WINDOW, pad_token_id=0, **SMALL), "paged"),
    "phi": (lambda v: T.PhiConfig(vocab_size=v, **SMALL), "paged"),
    "cohere": (lambda v: T.CohereConfig(vocab_size=v, pad_token_id=0, **SMALL), "paged"),
    "granite": (lambda v: T.GraniteConfig(vocab_size=v, **SMALL), "paged"),
    "mixtral": (
        lambda v: T.MixtralConfig(
            vocab_size=v, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, **SMALL
        ),
        "paged",
    ),
    "qwen3_moe": (
        lambda v: T.Qwen3MoeConfig(
            vocab_size=v, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **HEAD
        ),
        "paged",
    ),
    "gpt2": (
        lambda v: T.GPT2Config(vocab_size=v, n_positions=512, n_embd=64, n_layer=2, n_head=4, initializer_range=0.1),
        "paged",
    ),
    "gpt_neox": (lambda v: T.GPTNeoXConfig(vocab_size=v, **{**SMALL, "num_key_value_heads": 4}), "paged"),
    "gpt_bigcode_mqa": (
        lambda v: T.GPTBigCodeConfig(
            vocab_size=v, n_positions=512, n_embd=64, n_layer=2, n_head=4, multi_query=True, initializer_range=0.1
        ),
        "paged",
    ),
    "opt": (
        lambda v: T.OPTConfig(
            vocab_size=v,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=64,
            max_position_embeddings=512,
            init_std=0.1,
        ),
        "paged",
    ),
    "mistral": (lambda v: T.MistralConfig(vocab_size=v, sliding_window=WINDOW, **SMALL), "paged"),
    "qwen2": (
        lambda v: T.Qwen2Config(
            vocab_size=v, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SMALL
        ),
        "paged",
    ),
    "starcoder2": (lambda v: T.Starcoder2Config(vocab_size=v, sliding_window=WINDOW, **SMALL), "paged"),
    "gemma2": (
        lambda v: T.Gemma2Config(
            vocab_size=v, sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=30.0, **HEAD
        ),
        "paged",
    ),
    "gemma3": (
        lambda v: T.Gemma3TextConfig(vocab_size=v, sliding_window=WINDOW, **{**HEAD, "num_hidden_layers": 6}),
        "paged",
    ),
    "gpt_oss": (
        lambda v: T.GptOssConfig(
            vocab_size=v, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, **HEAD
        ),
        "paged",
    ),
    "cohere2": (
        lambda v: T.Cohere2Config(
            vocab_size=v, sliding_window=WINDOW, pad_token_id=0, **{**SMALL, "num_hidden_layers": 4}
        ),
        "paged",
    ),
    "olmo2": (lambda v: T.Olmo2Config(vocab_size=v, **SMALL), "paged"),
    "deepseek_v3_mla": (
        lambda v: T.DeepseekV3Config(
            vocab_size=v,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            max_position_embeddings=512,
            initializer_range=0.1,
        ),
        "paged",
    ),
    "falcon_alibi": (
        lambda v: T.FalconConfig(
            vocab_size=v, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True, initializer_range=0.1
        ),
        "padded",
    ),
    "bloom": (
        lambda v: T.BloomConfig(vocab_size=v, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.1),
        "padded",
    ),
}

# Families with sliding windows on some layers and full attention on others: the prefix cache keeps
# copies of their windows (a model of window layers only keeps no blocks to cache).
WINDOWED = ("gemma3", "gpt_oss", "qwen2", "gemma2", "cohere2")

# Models weightq refuses at load, and what the refusal must say.
REFUSED: dict[str, tuple[Callable[[int], object], str]] = {
    "mamba": (
        lambda v: T.MambaConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2, state_size=8),
        "recurrent state",
    ),
    "llama4_chunked": (
        lambda v: T.Llama4TextConfig(vocab_size=v, attention_chunk_size=32, num_local_experts=2, **HEAD),
        "chunked",
    ),
}


def build(name: str, out, tokenizer, table=None) -> str:
    """Save family `name`'s tiny model (seeded) and the tokenizer to `out`; returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM

    factory = (table or FAMILIES)[name][0]
    config = factory(len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id  # the model's EOS is the tokenizer's (see test_eos_of_the_model)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)

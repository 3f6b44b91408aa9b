"""`builtin:tiny` (a seeded random Llama) and `builtin:tiny-t5` (a seeded random T5, served by the
padded runner), with one byte-level BPE tokenizer, built locally once.

builtin:tiny is the embedded default of `make run` and the tests: no download, the same weights on
every machine. Random weights say nothing of quality; with initializer_range 0.1 (not the usual
0.02) greedy output is diverse enough that comparing engines token for token means something.
A random T5 is harder: at initializer_factor 1 its output ignores the input (one token repeated);
larger factors make T5's unscaled attention saturate, and fp32 noise then flips clear choices.
`shape_t5` gives diverse output with top1-top2 gaps far above the noise (measured: 85 distinct
tokens over 6 prompts, noise ~3e-3, 1st-percentile gap ~0.2).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
VERSION = "v1"  # bump when the recipe below changes: the cache directory is keyed by it
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
TINY_T5 = {
    "d_model": 256,
    "d_ff": 1024,
    "d_kv": 64,
    "num_layers": 4,
    "num_decoder_layers": 4,
    "num_heads": 4,
    "initializer_factor": 3.0,
    "tie_word_embeddings": False,
}
BUILDERS = ("tiny", "tiny-t5")


def shape_t5(model) -> None:
    """Re-scale a freshly initialised T5 (built with initializer_factor 3): embeddings and query/key
    projections x0.3, so attention stays soft and the input still matters."""
    import torch

    with torch.no_grad():
        model.shared.weight.mul_(0.3)
        for name, param in model.named_parameters():
            if name.endswith((".q.weight", ".k.weight")):
                param.mul_(0.3)


def cache_root() -> Path:
    return Path(os.environ.get("WEIGHTQ_CACHE", Path.home() / ".cache" / "weightq"))


def builtin_path(name: str) -> Path:
    """Directory of a built-in model, built on first use (atomically: concurrent builders are safe)."""
    if name not in BUILDERS:
        known = ", ".join(BUILTIN_PREFIX + b for b in BUILDERS)
        raise ValueError(f"unknown built-in model {BUILTIN_PREFIX}{name!r}; available: {known}")
    target = cache_root() / f"builtin-{name}-{VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build_tiny(tmp, seq2seq=name == "tiny-t5")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
        log.info("built %s%s into %s", BUILTIN_PREFIX, name, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tiny(out: Path, seq2seq: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        T5Config,
        T5ForConditionalGeneration,
    )

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY["vocab_size"],
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    if seq2seq:  # the decoder starts from the pad token, as T5's does
        ids = dict(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
        model = T5ForConditionalGeneration(
            T5Config(**TINY_T5, vocab_size=len(fast), decoder_start_token_id=fast.pad_token_id, **ids)
        )
        shape_t5(model)
        model.generation_config.decoder_start_token_id = fast.pad_token_id
    else:
        config = LlamaConfig(
            **{**TINY, "vocab_size": len(fast)},
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
        )
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out)

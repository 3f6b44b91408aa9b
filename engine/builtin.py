"""`builtin:tiny`: a seeded random Llama and a byte-level BPE tokenizer, built locally once.

It is the embedded default of `make run` and the tests: no download, the same weights on every
machine. Random weights say nothing of quality; with initializer_range 0.1 (not the usual 0.02)
greedy output is diverse enough that comparing engines token for token means something.
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


def cache_root() -> Path:
    return Path(os.environ.get("WEIGHTQ_CACHE", Path.home() / ".cache" / "weightq"))


def builtin_path(name: str) -> Path:
    """Directory of a built-in model, built on first use (atomically: concurrent builders are safe)."""
    if name != "tiny":
        raise ValueError(f"unknown built-in model {BUILTIN_PREFIX}{name!r}; available: {BUILTIN_PREFIX}tiny")
    target = cache_root() / f"builtin-tiny-{VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        _build_tiny(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").exists():
                raise
        log.info("built %stiny into %s", BUILTIN_PREFIX, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tiny(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

    config = LlamaConfig(
        **{**TINY, "vocab_size": len(fast)},
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    model.save_pretrained(out)

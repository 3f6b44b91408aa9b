"""Loading a transformers causal LM for the paged engine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .builtin import BUILTIN_PREFIX, builtin_path
from .kv_cache import KVGeometry

log = logging.getLogger(__name__)


class ModelNotFound(RuntimeError):
    """The model is neither built in, a local directory, nor in the Hugging Face cache."""


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object  # a transformers PreTrainedTokenizerBase
    path: str
    device: torch.device
    dtype: torch.dtype
    geometry: KVGeometry
    context_limit: int
    eos_token_ids: frozenset[int]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        out = getattr(torch, dtype)
    except AttributeError:
        out = None
    if not isinstance(out, torch.dtype) or not out.is_floating_point:
        raise ValueError(f"dtype: {dtype!r} is not a floating-point torch dtype (try float32, bfloat16, float16)")
    return out


def _from_pretrained(path: str, dtype: torch.dtype, attn: str, *, local_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn, local_files_only=local_only
    )
    return tokenizer, model


def _not_found(spec: str, local: bool, error: Exception) -> str:
    if local:
        return f"MODEL={spec!r}: the directory exists but holds no loadable model ({error})"
    return (
        f"MODEL={spec!r}: not a local directory, not in the Hugging Face cache, and not downloadable "
        "(offline?). Set MODEL to a local model directory or builtin:tiny, or download it first with "
        f"`huggingface-cli download {spec}`"
    )


def geometry_of(config, dtype: torch.dtype) -> KVGeometry:
    """KV shape from a model config (Llama/Mistral/Qwen style, or GPT-2 style names)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return KVGeometry(layers, kv_heads, head_dim, dtype)


def context_limit_of(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def load_model(
    spec: str, *, device: str = "auto", dtype: str = "auto", attn_implementation: str, allow_download: bool = True
) -> LoadedModel:
    """Load `spec`: builtin:NAME, a local directory, or a hub id (from the local cache first; downloaded
    only if `allow_download`)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = str(builtin_path(spec[len(BUILTIN_PREFIX) :])) if spec.startswith(BUILTIN_PREFIX) else spec
    local = Path(path).exists()
    try:
        tokenizer, model = _from_pretrained(path, dt, attn_implementation, local_only=True)
    except OSError as e:
        if local or not allow_download:
            raise ModelNotFound(_not_found(spec, local, e)) from e
        try:  # not in the local cache: let the hub client download it
            tokenizer, model = _from_pretrained(path, dt, attn_implementation, local_only=False)
        except OSError as e2:
            raise ModelNotFound(_not_found(spec, local, e2)) from e2
    model.to(dev).eval()
    config = model.config
    eos = set()
    for source in (getattr(model, "generation_config", None), config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list | tuple):
            eos.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    geometry = geometry_of(config, dt)
    limit = context_limit_of(config)
    log.info(
        "loaded %s on %s (%s): %d layers, %d KV heads x %d, context %d, %d B of KV per token",
        spec,
        dev,
        str(dt).removeprefix("torch."),
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        limit,
        geometry.bytes_per_token,
    )
    return LoadedModel(model, tokenizer, path, dev, dt, geometry, limit, frozenset(eos))

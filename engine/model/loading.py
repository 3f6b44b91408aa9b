"""Loading a transformers model for the engine, and choosing the runner that can serve it.

Decoder-only models whose attention goes through transformers' attention interface run on the
paged runner; encoder-decoder models (T5, BART, ...) and models without that interface run on the
padded runner (engine/runner/padded.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runner.kv_cache import KVGeometry
from .builtin import BUILTIN_PREFIX, builtin_path

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
    runner: str = "paged"  # "paged" or "padded"
    decoder_start_id: int | None = None  # encoder-decoder models

    @property
    def seq2seq(self) -> bool:
        return bool(getattr(self.model.config, "is_encoder_decoder", False))


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


def choose_runner(config, requested: str = "auto") -> str:
    """ "paged" when the model can use the paged attention backend, else "padded"; a request for
    the paged runner that the model cannot honour raises ValueError naming the reason."""
    if requested not in ("auto", "paged", "padded"):
        raise ValueError(f"runner: must be auto, paged or padded (got {requested!r})")
    from ..attention.probe import check_state_space

    check_state_space(config)
    why = None
    if getattr(config, "is_encoder_decoder", False):
        why = "it is an encoder-decoder model"
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        try:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        except KeyError:
            cls = None
        if cls is None or not getattr(cls, "_supports_attention_backend", False):
            why = f"{type(config).__name__} does not route attention through transformers' attention interface"
    if requested == "paged" and why:
        raise ValueError(f"runner: the paged runner cannot serve this model ({why}); use runner=padded or auto")
    if requested == "auto":
        if why:
            log.info("padded runner: %s", why)
        return "padded" if why else "paged"
    return requested


def _from_pretrained(path: str, dtype: torch.dtype, attn: str, runner: str, *, local_only: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    kind = choose_runner(config, runner)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    cls = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    # The padded runner uses the model's own attention (its default: SDPA where supported).
    model = cls.from_pretrained(
        path, dtype=dtype, attn_implementation=attn if kind == "paged" else None, local_files_only=local_only
    )
    return tokenizer, model, kind


def _not_found(spec: str, local: bool, error: Exception) -> str:
    if local:
        return f"MODEL={spec!r}: the directory exists but holds no loadable model ({error})"
    return (
        f"MODEL={spec!r}: not a local directory, not in the Hugging Face cache, and not downloadable "
        "(offline?). Set MODEL to a local model directory or builtin:tiny, or download it first with "
        f"`huggingface-cli download {spec}`"
    )


def _first(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{type(config).__name__} has none of {names}")


def geometry_of(config, dtype: torch.dtype) -> KVGeometry:
    """KV shape from a model config (Llama/Mistral/Qwen, GPT-2, T5 or BART style names); for an
    encoder-decoder model, its decoder's (one token of self- or cross-attention cache)."""
    layers = _first(config, "num_decoder_layers", "decoder_layers", "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "decoder_attention_heads", "num_attention_heads", "n_head", "num_heads")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or getattr(config, "d_kv", None) or hidden // heads
    return KVGeometry(layers, kv_heads, head_dim, dtype)


def context_limit_of(config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def load_model(
    spec: str,
    *,
    device: str = "auto",
    dtype: str = "auto",
    attn_implementation: str,
    allow_download: bool = True,
    runner: str = "auto",
) -> LoadedModel:
    """Load `spec`: builtin:NAME, a local directory, or a hub id (from the local cache first; downloaded
    only if `allow_download`). `attn_implementation` applies to the paged runner only."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = str(builtin_path(spec[len(BUILTIN_PREFIX) :])) if spec.startswith(BUILTIN_PREFIX) else spec
    local = Path(path).exists()
    try:
        tokenizer, model, kind = _from_pretrained(path, dt, attn_implementation, runner, local_only=True)
    except OSError as e:
        if local or not allow_download:
            raise ModelNotFound(_not_found(spec, local, e)) from e
        try:  # not in the local cache: let the hub client download it
            tokenizer, model, kind = _from_pretrained(path, dt, attn_implementation, runner, local_only=False)
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
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else None
    outside = sorted(e for e in eos if vocab is not None and e >= vocab)
    if outside:
        log.warning(
            "%s: EOS id(s) %s are outside the model's vocabulary (%d): generation stops at the tokenizer's "
            "EOS (%s) only, where transformers' generate() would not stop at all",
            spec,
            outside,
            vocab,
            tokenizer.eos_token_id,
        )
    if not eos - set(outside) and tokenizer.eos_token_id is not None:
        # vLLM stops at the tokenizer's EOS too; generate() with no EOS in the model's config never stops,
        # so a comparison with it differs where the output reaches this id (not a numerical divergence)
        log.warning(
            "%s: the model's config names no EOS in its vocabulary: generation stops at the tokenizer's EOS (%s), "
            "where transformers' generate() would not stop (ignore_eos=True runs on)",
            spec,
            tokenizer.eos_token_id,
        )
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    geometry = geometry_of(config, dt)
    limit = context_limit_of(config)
    start = getattr(model.generation_config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "decoder_start_token_id", None)
    log.info(
        "loaded %s on %s (%s) for the %s runner: %d layers, %d KV heads x %d, context %d, %d B of KV per token",
        spec,
        dev,
        str(dt).removeprefix("torch."),
        kind,
        geometry.num_layers,
        geometry.num_kv_heads,
        geometry.head_dim,
        limit,
        geometry.bytes_per_token,
    )
    start = start if getattr(config, "is_encoder_decoder", False) else None
    return LoadedModel(model, tokenizer, path, dev, dt, geometry, limit, frozenset(eos), kind, start)

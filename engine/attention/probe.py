"""What a model asks of attention, learned at load: refuse there what the paged runner cannot honour.

transformers calls the attention function with per-layer extras as keyword arguments; a function
that drops one it does not know computes something else, silently (a model with sliding windows,
soft-capping or attention sinks gives other text). So before a model serves, one tiny forward runs
with a recording attention function: every layer's call is checked against what paged.py implements,
and each layer's window and KV shapes come out of it (the KV layout, engine/runner/kv_cache.py). Features
that never reach the attention function (state-space layers, attention that masks by chunks or looks
ahead) are read from the config. Anything else is refused with a message saying what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

# Keyword arguments that change what attention computes, and which paged.py honours.
HANDLED = frozenset({"scaling", "sliding_window", "softcap", "s_aux"})
# Ones that do not change the result (bookkeeping transformers forwards to every layer).
INERT = frozenset(
    {
        "dropout",  # 0 in eval mode (checked)
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "weightq_meta",
        "is_causal",  # True (checked); False would be bidirectional
    }
)
# Model types whose layers keep a recurrent state instead of (or besides) a KV cache.
STATE_SPACE = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "falcon_h1",
        "zamba",
        "zamba2",
        "bamba",
        "nemotron_h",
        "granitemoehybrid",
        "lfm2",
        "lfm2_moe",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "plamo2",
        "minimax",
    }
)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


class UnsupportedModel(ValueError):
    """The model uses an attention feature weightq's paged runner cannot compute correctly."""


@dataclass(frozen=True, slots=True)
class LayerCall:
    """One layer's attention call as the probe saw it."""

    layer: int
    heads: int
    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None
    softcap: float | None
    sinks: bool


def _name(config) -> str:
    return f"{type(config).__name__} (model_type {getattr(config, 'model_type', '?')!r})"


def check_state_space(config) -> None:
    """Refuse models whose layers keep a recurrent state: neither runner has a place for it."""
    model_type = getattr(config, "model_type", "")
    if model_type in STATE_SPACE or any(
        getattr(config, a, None) for a in ("ssm_state_size", "state_size", "mamba_d_state", "mamba_expand")
    ):
        raise UnsupportedModel(
            f"{_name(config)}: its layers keep a recurrent state (state-space or linear attention), not a "
            "KV cache; weightq's runners (paged and padded) serve attention models only. Serve it with "
            "transformers' generate() or an engine that runs state-space models"
        )


def check_config(config) -> None:
    """Refuse, from the config alone, models whose layers are not all plain causal attention."""
    check_state_space(config)
    what = _name(config)
    types = set(getattr(config, "layer_types", None) or ())
    if types - ATTENTION_LAYER_TYPES:
        raise UnsupportedModel(
            f"{what}: layer types {sorted(types - ATTENTION_LAYER_TYPES)} are not causal (full or "
            "sliding-window) attention; weightq serves models whose every layer is"
        )
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModel(
            f"{what}: chunked attention (attention_chunk_size={config.attention_chunk_size}) is not "
            "implemented by the paged runner; use RUNNER=padded (the model's own attention)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{what}: bidirectional attention cannot generate causally; it is not a decoder")


def probe(model: torch.nn.Module, attn_name: str, backend_fn) -> list[LayerCall]:
    """Run three tokens through the model with a recording attention function under `attn_name`
    (then `backend_fn` again); check each call; returns one LayerCall per layer, in layer order."""
    config = model.config
    check_config(config)
    calls: dict[int, LayerCall] = {}
    problems: set[str] = set()

    def record(module, query, key, value, attention_mask, **kwargs):
        unknown = set(kwargs) - HANDLED - INERT
        if unknown:
            problems.add(f"passes {sorted(unknown)} to its attention function")
        if attention_mask is not None:
            problems.add("passes an attention mask of its own")
        if kwargs.get("is_causal") is False:
            problems.add("asks for bidirectional (non-causal) attention")
        if kwargs.get("dropout"):
            problems.add("uses attention dropout at inference")
        sinks = kwargs.get("s_aux")
        window = kwargs.get("sliding_window")
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            problems.add(f"has an attention module ({type(module).__name__}) without a layer_idx")
        else:
            softcap = kwargs.get("softcap")
            calls[layer] = LayerCall(
                layer,
                query.shape[1],
                key.shape[1],
                key.shape[3],
                value.shape[3],
                int(window) if window else None,
                float(softcap) if softcap else None,
                sinks is not None,
            )
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=gqa)
        return out.transpose(1, 2), None

    device = next(model.parameters()).device
    AttentionInterface.register(attn_name, record)
    try:
        with torch.inference_mode():
            model(
                input_ids=torch.tensor([[1, 2, 3]], device=device),
                position_ids=torch.arange(3, device=device)[None],
                use_cache=False,
            )
    finally:
        AttentionInterface.register(attn_name, backend_fn)
    layers = getattr(config, "num_hidden_layers", None) or len(calls)
    if not calls:
        problems.add("never calls the attention function")
    elif sorted(calls) != list(range(layers)):
        problems.add(f"calls attention in layers {sorted(calls)} of {layers}: the others are not attention")
    shapes = {(c.kv_heads, c.k_dim, c.v_dim) for c in calls.values()}
    if len(shapes) > 1:
        problems.add(f"has layers of different KV shapes {sorted(shapes)} (kv heads, K size, V size)")
    if problems:
        raise UnsupportedModel(
            f"{_name(config)} " + "; ".join(sorted(problems)) + ": the paged runner would compute something else. "
            "Use RUNNER=padded (the model's own attention), or a family the README lists"
        )
    return [calls[i] for i in sorted(calls)]


def check_backend(calls: list[LayerCall], backend: str) -> str | None:
    """Why `backend` cannot serve these layers (None: it can)."""
    if backend not in ("flash", "flash_reference"):
        return None
    if any(c.sinks for c in calls):
        return "attention sinks (s_aux): flash-attn has no sink logit"
    if any(c.k_dim != c.v_dim for c in calls):
        return "K and V heads of different sizes (MLA): flash-attn 2 needs one head size"
    return None

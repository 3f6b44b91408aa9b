"""What the padded runner needs to know about encoder-decoder families (T5, BART and kin).

Two things differ between families and cannot be read off the generic interfaces: how the decoder
numbers positions (BART: learned absolute positions counted from the cache length, the same for
every row, so a left-padded batch needs them per row; T5: relative buckets, which left padding
does not change), and where the cross-attention projections live (used to give admitted rows their
cross K/V without a decoder pass of their own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RowPositions(nn.Module):
    """A BART-style learned decoder position embedding that reads per-row positions.

    BART's decoder numbers positions from the cache length, the same for every row; in a
    left-padded batch each row's real tokens start at a different column, so the runner sets
    `start` (each row's position of its first fed token) before every forward."""

    def __init__(self, inner: nn.Embedding) -> None:
        super().__init__()
        self.inner = inner
        self.start: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, cache_length: int = 0, position_ids: torch.Tensor | None = None):
        if self.start is None:
            return self.inner(input_ids, cache_length, position_ids=position_ids)
        steps = torch.arange(input_ids.shape[1], device=self.start.device)
        pos = (self.start[:, None] + steps[None, :]).clamp(min=0)
        return F.embedding(pos + getattr(self.inner, "offset", 0), self.inner.weight)


def patch_decoder_positions(model: nn.Module) -> RowPositions | None:
    """Install RowPositions on a decoder with absolute learned positions; None when the decoder has
    none (T5: relative position buckets, unchanged by left padding). Unknown kinds are refused."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if get_decoder is not None else None
    emb = getattr(decoder, "embed_positions", None)
    if emb is None:
        return None
    if isinstance(emb, RowPositions):
        return emb
    if not isinstance(emb, nn.Embedding):
        raise NotImplementedError(
            f"{type(model).__name__}: decoder positions of type {type(emb).__name__} cannot be set per row; "
            "the padded runner serves T5-style (relative) and BART-style (learned) decoders"
        )
    decoder.embed_positions = RowPositions(emb)
    return decoder.embed_positions


def cross_projections(model: nn.Module) -> list | None:
    """Per decoder layer, a function from encoder states [N, S, d] to that layer's cross-attention
    K and V [N, H, S, D], for the families whose modules we know (T5, BART and its kin); None
    otherwise. With them, admitted rows join the batch's decode step directly instead of running
    a decoder pass of their own (the same projections the model would apply)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None:
        return None

    def split(states: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int):
        shape = (states.shape[0], states.shape[1], -1, head_dim)
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)

    out = []
    for layer in getattr(decoder, "block", None) or getattr(decoder, "layers", None) or []:
        t5 = getattr(layer, "layer", None)
        att = t5[1].EncDecAttention if t5 is not None and hasattr(t5[1], "EncDecAttention") else None
        if att is not None:
            out.append(lambda st, a=att: split(st, a.k(st), a.v(st), a.key_value_proj_dim))
            continue
        att = getattr(layer, "encoder_attn", None)
        if att is None or not hasattr(att, "k_proj") or not hasattr(att, "head_dim"):
            return None
        out.append(lambda st, a=att: split(st, a.k_proj(st), a.v_proj(st), a.head_dim))
    return out or None

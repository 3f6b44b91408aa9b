"""A PEFT LoRA adapter read from disk: `adapter_config.json` and `adapter_model.safetensors` (or .bin).

Only what serves exactly is accepted: plain LoRA on linear projections (attention and MLP, any rank,
rsLoRA scaling), no bias, no DoRA, no trained embeddings or heads (`modules_to_save`). Anything else is
refused at load with the adapter's name and the option, never served approximately.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

PREFIX = "base_model.model."  # PEFT's name of the wrapped model in its saved keys
UNSUPPORTED = {  # adapter_config.json option -> the value weightq serves
    "use_dora": False,
    "fan_in_fan_out": False,
}


class AdapterError(ValueError):
    """An adapter weightq cannot serve (its name, the path and why)."""


@dataclass(slots=True)
class LoraAdapter:
    """`weights`: module name (as in the base model) -> (A [rank, in], B [out, rank] x scaling)."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def parse_modules(spec: str) -> dict[str, str]:
    """LORA_MODULES ("name=path-or-hub-id,..."; vLLM's --lora-modules) as {name: path}."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise AdapterError(f"lora_modules: {item!r} must be name=path")
        if name in out:
            raise AdapterError(f"lora_modules: adapter {name!r} is named twice")
        out[name] = path
    return out


def load_adapter(
    name: str,
    path: str,
    linears: dict[str, torch.nn.Linear],
    *,
    device: torch.device,
    dtype: torch.dtype,
    allow_download: bool,
) -> LoraAdapter:
    """Read and check the adapter at `path` (a directory, or a hub id where downloads are allowed)
    against the base model's linear layers (by module name); its tensors on `device` in `dtype`, B scaled."""
    where = _resolve(name, path, allow_download)
    try:
        cfg = json.loads((where / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: no readable adapter_config.json in {path} ({e})") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not served (LoRA only)")
    for option, wanted in UNSUPPORTED.items():
        if cfg.get(option, wanted) != wanted:
            raise AdapterError(f"adapter {name!r}: {option}={cfg.get(option)!r} is not served")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={cfg['bias']!r} is not served (bias='none' only)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save {cfg['modules_to_save']} is not served")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r}: rank_pattern/alpha_pattern are not served")
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    tensors = _tensors(name, where)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        body = key.removeprefix(PREFIX)
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in body and body.endswith(".weight"):
                module = body.split(marker)[0]
                pairs.setdefault(module, {})[part] = t
                break
        else:
            raise AdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight (not served)")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        base = linears.get(module)
        if base is None:
            raise AdapterError(f"adapter {name!r}: module {module!r} is not a linear layer of the base model")
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise AdapterError(f"adapter {name!r}: module {module!r} has only one of lora_A/lora_B")
        if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
            raise AdapterError(
                f"adapter {name!r}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; the base model needs "
                f"({rank}, {base.in_features}) and ({base.out_features}, {rank})"
            )
        weights[module] = (
            a.to(device=device, dtype=dtype).contiguous(),
            (b.float() * scaling).to(device=device, dtype=dtype).contiguous(),
        )
    if not weights:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in {path}")
    return LoraAdapter(name, path, rank, weights)


def read_adapter(name: str, path: str, resident, dtype: torch.dtype, allow_download: bool) -> LoraAdapter:
    """An adapter's weights on the host (CPU), checked against `resident`'s layers: `Resident.place`
    copies them to the device when a request needs it."""
    cpu = torch.device("cpu")
    return load_adapter(name, path, resident.targets, device=cpu, dtype=dtype, allow_download=allow_download)


def _resolve(name: str, path: str, allow_download: bool) -> Path:
    where = Path(path).expanduser()
    if where.is_dir():
        return where
    if not allow_download:
        raise AdapterError(f"adapter {name!r}: {path} is not a directory (downloads are off: ALLOW_DOWNLOAD)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.*"]))
    except Exception as e:  # the hub's errors are many; the message is what the operator needs
        raise AdapterError(f"adapter {name!r}: cannot fetch {path} ({e})") from None


def _tensors(name: str, where: Path) -> dict[str, torch.Tensor]:
    st, pt = where / "adapter_model.safetensors", where / "adapter_model.bin"
    if st.exists():
        from safetensors.torch import load_file

        return load_file(str(st))
    if pt.exists():
        return torch.load(str(pt), map_location="cpu", weights_only=True)
    raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors (or .bin) in {where}")

"""A PEFT LoRA adapter read from disk: `adapter_config.json` and `adapter_model.safetensors` (or .bin).

Only what serves exactly is accepted: plain LoRA on linear projections (attention and MLP, any rank,
rsLoRA scaling), no bias, no DoRA, no trained embeddings or heads (`modules_to_save`). Anything else is
refused at load with the adapter's name and the option, never served approximately.

Where an adapter comes from is read from its spec alone (`is_local`), never from the disk: a path is a
directory, anything else a hub id. Errors name the adapter and the problem, never a file's content nor
a path (a run-time load's reason reaches the caller who asked for it: LORA_ERRORS).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PREFIX = "base_model.model."  # PEFT's name of the wrapped model in its saved keys
UNSUPPORTED = {  # adapter_config.json option -> the value weightq serves
    "use_dora": False,
    "fan_in_fan_out": False,
}


# A hub id, as the hub spells one: `name` or `org/name` (weightq.settings.HUB_ID is the same pattern).
HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
SHOWN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # a config value or tensor name an error may repeat


class AdapterError(ValueError):
    """An adapter weightq cannot serve: its name and why (no path, no file content)."""


def is_local(spec: str) -> bool:
    """The rule weightq.settings.adapter_is_local states for the gateway and the workers' checks: a spec
    starting with "/", "~" or "." is a directory (so a relative one is written ./dir); anything else is
    a hub id, even where a directory of that name exists."""
    return spec.startswith(("/", "~", "."))


def _shown(value: object) -> str:
    """A value from the adapter's files as an error may quote it: short plain words, else its type."""
    if isinstance(value, bool | int | float) or (isinstance(value, str) and SHOWN.fullmatch(value)):
        return repr(value)
    return f"a {type(value).__name__}"


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
    cfg = _config(name, where)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {_shown(cfg.get('peft_type'))} is not served (LoRA only)")
    for option, wanted in UNSUPPORTED.items():
        if cfg.get(option, wanted) != wanted:
            raise AdapterError(f"adapter {name!r}: {option}={_shown(cfg.get(option))} is not served")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: bias={_shown(cfg['bias'])} is not served (bias='none' only)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter {name!r}: modules_to_save is not served")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r}: rank_pattern/alpha_pattern are not served")
    rank, alpha = _number(name, cfg, "r", 8, int), _number(name, cfg, "lora_alpha", 8, float)
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
            raise AdapterError(f"adapter {name!r}: tensor {_shown(key)} is not a LoRA A/B weight (not served)")
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        base = linears.get(module)
        if base is None:
            raise AdapterError(f"adapter {name!r}: module {_shown(module)} is not a linear layer of the base model")
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise AdapterError(f"adapter {name!r}: module {_shown(module)} has only one of lora_A/lora_B")
        if a.shape != (rank, base.in_features) or b.shape != (base.out_features, rank):
            raise AdapterError(
                f"adapter {name!r}: {_shown(module)} has A {tuple(a.shape)}, B {tuple(b.shape)}; the base model needs "
                f"({rank}, {base.in_features}) and ({base.out_features}, {rank})"
            )
        weights[module] = (
            a.to(device=device, dtype=dtype).contiguous(),
            (b.float() * scaling).to(device=device, dtype=dtype).contiguous(),
        )
    if not weights:
        raise AdapterError(f"adapter {name!r}: no LoRA weights in adapter_model")
    return LoraAdapter(name, path, rank, weights)


def read_adapter(name: str, path: str, resident, dtype: torch.dtype, allow_download: bool) -> LoraAdapter:
    """An adapter's weights on the host (CPU), checked against `resident`'s layers: `Resident.place`
    copies them to the device when a request needs it."""
    cpu = torch.device("cpu")
    return load_adapter(name, path, resident.targets, device=cpu, dtype=dtype, allow_download=allow_download)


def _resolve(name: str, path: str, allow_download: bool) -> Path:
    if is_local(path):
        where = Path(path).expanduser()
        if not where.is_dir():
            raise AdapterError(f"adapter {name!r}: its path is not a directory")
        return where
    if not HUB_ID.fullmatch(path) or ".." in path:
        raise AdapterError(f"adapter {name!r}: neither a directory (a path: /, ~ or . first) nor a hub id (org/name)")
    if Path(path).is_dir():  # a relative directory written as a hub id would be fetched from the hub instead
        raise AdapterError(f"adapter {name!r}: {path!r} reads as a hub id; write ./{path} for the directory")
    if not allow_download:
        raise AdapterError(f"adapter {name!r}: hub id {path!r} cannot be fetched: downloads are off (ALLOW_DOWNLOAD)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "adapter_model.*"]))
    except Exception as e:  # the hub's messages carry local cache paths: its error's kind says enough
        raise AdapterError(f"adapter {name!r}: cannot fetch hub id {path!r} ({type(e).__name__})") from None


def _config(name: str, where: Path) -> dict:
    try:
        text = (where / "adapter_config.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: no readable adapter_config.json in its directory") from None
    except OSError as e:
        raise AdapterError(f"adapter {name!r}: adapter_config.json cannot be read ({e.strerror})") from None
    except ValueError:  # its bytes: not UTF-8
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not UTF-8 text") from None
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError):  # the parser's message quotes the text
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not valid JSON") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"adapter {name!r}: adapter_config.json is not a JSON object")
    return cfg


def _number(name: str, cfg: dict, key: str, default: float, kind: type) -> Any:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or kind(value) != value:
        raise AdapterError(f"adapter {name!r}: adapter_config.json's {key} must be a positive {kind.__name__}")
    return kind(value)


def _tensors(name: str, where: Path) -> dict[str, torch.Tensor]:
    st, pt = where / "adapter_model.safetensors", where / "adapter_model.bin"
    try:
        if st.exists():
            from safetensors.torch import load_file

            return load_file(str(st))
        if pt.exists():
            tensors = torch.load(str(pt), map_location="cpu", weights_only=True)
            if isinstance(tensors, dict) and all(isinstance(t, torch.Tensor) for t in tensors.values()):
                return tensors
            raise AdapterError(f"adapter {name!r}: adapter_model.bin is not a dict of tensors")
    except AdapterError:
        raise
    except Exception as e:  # safetensors' and torch's messages quote headers, pickled globals, paths
        file = st.name if st.exists() else pt.name
        raise AdapterError(f"adapter {name!r}: {file} cannot be read as weights ({type(e).__name__})") from None
    raise AdapterError(f"adapter {name!r}: no adapter_model.safetensors (or .bin)")

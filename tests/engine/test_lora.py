"""Multi-LoRA on the paged runner: PEFT adapters of any rank on the attention and MLP projections,
mixed with the base model in the same steps (chunked prefill, preemption), each request token for
token equal to generate() on PEFT's merged model of its adapter; their memory out of the budget; and
what cannot be served, refused by name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM
from weightq.batcher import BatcherConfig, ConfigError
from weightq.engine import Engine, EngineConfig
from weightq.engine.lora import parse_modules

from tests.reference import assert_greedy_equal, mixed_requests

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: str, out, rank: int, seed: int, targets=TARGETS, **extra) -> str:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra)
    peft = get_peft_model(model, cfg)
    with torch.no_grad():  # B non-zero and large enough that every adapter changes the greedy path
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    peft.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def adapters(tiny_path, tmp_path_factory):
    return make_adapters(tiny_path, tmp_path_factory.mktemp("lora"))


def make_adapters(tiny_path, root) -> dict[str, str]:
    """Three adapters: rank 4 on every projection, rank 16 on three, rank 8 with rsLoRA scaling."""
    return {
        "ada": make_adapter(tiny_path, root / "ada", 4, 1),
        "bob": make_adapter(tiny_path, root / "bob", 16, 2, targets=["q_proj", "v_proj", "down_proj"]),
        "rs": make_adapter(tiny_path, root / "rs", 8, 3, use_rslora=True),
    }


def merged(tiny_path: str, path: str):
    base = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="eager")
    return PeftModel.from_pretrained(base, path).merge_and_unload().eval()


def spec(adapters: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in adapters.items())


def check_mixed_batch(tiny_path, adapters: dict[str, str], compile_: str, **config) -> None:
    """Base and three adapters in the same steps, adapters' requests sent back to the queue and
    prefilled again."""
    engine = Engine(
        EngineConfig(
            model=str(tiny_path),
            device="cpu",
            compile=compile_,
            lora_modules=spec(adapters),
            batcher=BatcherConfig(max_batch_weight=2048, max_total_tokens=320, max_prefill_weight=64),
            check_invariants=True,
            **config,
        )
    )
    assert engine.backend == config.get("attention", engine.backend)
    names = ["", "ada", "bob", "rs"]
    reqs = mixed_requests(12, seed=5, max_prompt=120, max_new=48)
    reqs = [replace(r, adapter=names[i % 4]) for i, r in enumerate(reqs)]
    handles = [engine.submit(r) for r in reqs]
    requeued: set[str] = set()
    while any(h.final is None for h in handles):  # adapters' requests sent back mid-prompt and mid-decode
        engine.step()
        for r in list(engine.batcher.running.values()):
            prompt = next(q for q in reqs if q.id == r.id)
            mid_prompt = 0 < r.prefilled < r.input_len and r.input_len > 64
            if prompt.adapter and r.id not in requeued and len(requeued) < 4 and (mid_prompt or r.generated > 5):
                engine.batcher.requeue(r.id)
                requeued.add(r.id)
    results = [h.final for h in handles]
    assert all(r.error is None for r in results), [r.error for r in results]
    assert len(requeued) == 4
    base = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation="eager").eval()
    for name in names:
        mine = [(q, r) for q, r in zip(reqs, results, strict=True) if q.adapter == name]
        model = merged(tiny_path, adapters[name]) if name else base
        assert_greedy_equal(model, [q for q, _ in mine], [r for _, r in mine])
    # the adapters change the output: the same prompt differs between base and adapters
    probe = [replace(reqs[0], id=f"p{n or 'base'}", adapter=n) for n in names]
    outs = [tuple(r.token_ids) for r in engine.generate(probe)]
    assert len(set(outs)) == len(outs)


def test_adapters_mixed_with_the_base_in_one_batch_equal_peft_merged(tiny_path, adapters):
    check_mixed_batch(tiny_path, adapters, "off")  # compiled: tests/engine/test_compile.py


def test_adapters_on_the_flash_path_through_its_stand_in(tiny_path, adapters):
    """flash.py's varlen and paged calls (engine/attention/flash_reference.py on the CPU) with adapters."""
    check_mixed_batch(tiny_path, adapters, "off", attention="flash_reference")


def test_adapter_slots_come_out_of_the_budget_as_they_are_taken_and_unknown_adapters_are_refused(tiny_path, adapters):
    limits = BatcherConfig(max_batch_weight=4096, max_total_tokens=1024)
    cfg = dict(model=str(tiny_path), device="cpu", compile="off", batcher=limits)
    plain = Engine(EngineConfig(**cfg))
    lora = Engine(EngineConfig(**cfg, lora_modules=spec(adapters)))
    resident, slots = lora.runner.lora, lora.batcher.adapters
    unit = lora.runner.cache.layout.page_bytes / lora.runner.cache.layout.block_size
    # a slot: rank 16 (MAX_LORA_RANK) on every linear layer but the head, whatever each adapter targets
    dims = sum(t.in_features + t.out_features for t in resident.targets.values())
    assert resident.slot_bytes == 16 * dims * 4 and slots.slot_weight == -(-resident.slot_bytes // unit)
    assert lora.batcher.budget == plain.batcher.budget and resident.nbytes == 0  # nothing taken before use
    assert set(resident.host["bob"].weights) == {
        f"model.layers.{i}.{m}" for i in range(plain.lm.model.config.num_hidden_layers)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }  # fmt: skip
    req = mixed_requests(1, seed=1, max_prompt=60, max_new=48)[0]
    lora.generate([replace(req, id="x", adapter="ada"), replace(req, id="y", adapter="bob")])
    assert slots.capacity == 2 and resident.nbytes == 2 * resident.slot_bytes
    assert lora.batcher.budget == plain.batcher.budget - 2 * slots.slot_weight
    refused = lora.generate([replace(req, adapter="nope")])[0]  # an error event, naming the field
    assert refused.error.startswith("model: adapter 'nope' is not loaded here (adapters: ada, bob, rs)")
    assert "model: adapter 'ada' is not loaded here" in plain.generate([replace(req, adapter="ada")])[0].error


def test_slots_are_reused_by_the_least_recently_used_idle_adapter_and_requests_wait_for_one(tiny_path, adapters):
    """Room for two slots and three adapters: a third adapter takes the slot of the one least recently
    used that no running request holds, and waits while both are in use; outputs stay exact."""
    cfg = dict(model=str(tiny_path), device="cpu", compile="off", check_invariants=True)
    probe = Engine(
        EngineConfig(
            **cfg, batcher=BatcherConfig(max_batch_weight=4096, max_total_tokens=320), lora_modules=spec(adapters)
        )
    )
    slot = probe.batcher.adapters.slot_weight
    budget = probe.batcher.weight.seq(320) + 2 * slot + 64
    engine = Engine(
        EngineConfig(
            **cfg, batcher=BatcherConfig(max_batch_weight=budget, max_total_tokens=320), lora_modules=spec(adapters)
        )
    )
    slots = engine.batcher.adapters
    assert slots.max_capacity == 2
    reqs = [
        replace(r, adapter=["ada", "bob", "rs"][i % 3])
        for i, r in enumerate(mixed_requests(9, seed=2, max_prompt=60, max_new=48))
    ]
    handles = [engine.submit(r) for r in reqs]
    placed = []
    while any(h.final is None for h in handles):
        engine.step()
        assert len(slots.slot_of) <= 2 and all(slots.users[a] for a in slots.users)
        in_use = {r.adapter for r in engine.batcher.running.values()}
        assert len(in_use) <= 2
        placed.extend(slots.loads)
    results = [h.final for h in handles]
    assert all(r.error is None for r in results) and slots.capacity == 2
    for name in ("ada", "bob", "rs"):
        mine = [(q, r) for q, r in zip(reqs, results, strict=True) if q.adapter == name]
        assert_greedy_equal(merged(tiny_path, adapters[name]), [q for q, _ in mine], [r for _, r in mine])


def test_adapters_load_and_unload_at_run_time(tiny_path, adapters, tmp_path):
    from weightq.engine.lora import AdapterError

    limits = BatcherConfig(max_batch_weight=4096, max_total_tokens=320)
    cfg = dict(model=str(tiny_path), device="cpu", compile="off", batcher=limits)
    engine = Engine(EngineConfig(**cfg, enable_lora=True))
    req = mixed_requests(1, seed=4, max_prompt=60, max_new=48)[0]
    assert "not loaded here (adapters: none)" in engine.generate([replace(req, adapter="ada")])[0].error
    engine.load_adapter("ada", adapters["ada"])
    got = engine.generate([replace(req, id="a1", adapter="ada"), replace(req, id="b1")])
    assert_greedy_equal(merged(tiny_path, adapters["ada"]), [replace(req, id="a1", adapter="ada")], got[:1])
    with pytest.raises(AdapterError, match="already loaded"):
        engine.load_adapter("ada", adapters["ada"])
    wide = make_adapter(tiny_path, tmp_path / "wide", 32, 9)
    with pytest.raises(AdapterError, match="rank 32 exceeds max_lora_rank 16"):
        engine.load_adapter("wide", wide)
    assert engine.stats()["adapter_errors"]["wide"].endswith("exceeds max_lora_rank 16")
    assert engine.unload_adapter("ada") and not engine.unload_adapter("ada")
    assert "not loaded here" in engine.generate([replace(req, id="a2", adapter="ada")])[0].error
    engine.generate([replace(req, id="b2")])  # the step frees its slot
    assert engine.batcher.adapters.slot_of == {} and "ada" not in engine.runner.lora.host
    with pytest.raises(AdapterError, match="not enabled"):
        Engine(EngineConfig(**cfg)).load_adapter("ada", adapters["ada"])


def test_what_cannot_be_served_is_refused_at_load(tiny_path, adapters, tmp_path):
    with pytest.raises(ConfigError, match="must be name=path"):
        parse_modules_checked("ada")
    with pytest.raises(ConfigError, match="named twice"):
        parse_modules_checked(f"a={adapters['ada']},a={adapters['bob']}")
    limits = BatcherConfig(max_batch_weight=2048, max_total_tokens=1024)
    cfg = dict(model=str(tiny_path), device="cpu", compile="off", batcher=limits)
    with pytest.raises(ConfigError, match=r"no readable adapter_config\.json"):
        Engine(EngineConfig(**cfg, lora_modules=f"x={tmp_path}"))
    dora = make_adapter(tiny_path, tmp_path / "dora", 4, 4, use_dora=True)
    with pytest.raises(ConfigError, match=r"'dora'.*use_dora=True is not served"):
        Engine(EngineConfig(**cfg, lora_modules=f"dora={dora}"))
    bad = tmp_path / "shape"
    bad.mkdir()
    conf = json.loads((tmp_path / "dora" / "adapter_config.json").read_text()) | {"use_dora": False, "r": 3}
    (bad / "adapter_config.json").write_text(json.dumps(conf))
    (bad / "adapter_model.safetensors").write_bytes((tmp_path / "dora" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="'shape'"):
        Engine(EngineConfig(**cfg, lora_modules=f"shape={bad}"))
    with pytest.raises(ConfigError, match="do not fit in max_batch_weight"):  # no room for one slot
        small = BatcherConfig(max_batch_weight=300, max_total_tokens=256)
        Engine(EngineConfig(**cfg | {"batcher": small}, lora_modules=spec(adapters)))
    with pytest.raises(ConfigError, match="paged runner only"):
        Engine(EngineConfig(**cfg, runner="padded", lora_modules=spec(adapters)))


def parse_modules_checked(text: str):
    from weightq.engine.builder import parse_lora

    assert parse_modules("a=/x, b=y") == {"a": "/x", "b": "y"}
    return parse_lora(text)

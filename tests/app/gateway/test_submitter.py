"""The gateway's group commit takes pending submissions tenant by tenant (app/gateway/submitter.py)."""

from __future__ import annotations

from dataclasses import dataclass

from weightq.gateway.submitter import fair_batch


@dataclass
class Job:
    tenant: str
    name: str


def names(items) -> list[str]:
    return [job.name for job, _ in items]


def test_a_batch_takes_each_tenant_in_turn_and_keeps_each_ones_order():
    pending = [(Job("flood", f"f{i}"), None) for i in range(300)] + [(Job("light", "l0"), None)]
    batch, rest = fair_batch(pending, 4)
    assert names(batch) == ["f0", "l0", "f1", "f2"] and names(rest) == [f"f{i}" for i in range(3, 300)]


def test_one_tenant_is_first_come_first_served():
    pending = [(Job("t", str(i)), None) for i in range(10)]
    batch, rest = fair_batch(pending, 4)
    assert names(batch) == ["0", "1", "2", "3"] and len(rest) == 6

"""plan.py: the config's policies cover every field once, and ``resolve`` decides every
sentinel for the job (no process group needed: the plan is pure)."""

from __future__ import annotations

import dataclasses

import pytest

from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.plan import Plan, policies, resolve
from zeropp_strategy.topology import Topology


def test_every_config_field_is_in_exactly_one_policy():
    config = ZeroConfig(stage=2, quantized_gradients=True, reduce_dtype="bf16", peer_timeout=5.0)
    seen: list[str] = []
    for policy in policies(config):
        for f in dataclasses.fields(policy):
            seen.append(f.name)
            assert getattr(policy, f.name) == getattr(config, f.name), f.name
    assert sorted(seen) == sorted(f.name for f in dataclasses.fields(ZeroConfig))


def _topo(world: int, per_node: int) -> Topology:
    return Topology(world_size=world, rank=0, ranks_per_node=per_node)


@pytest.mark.parametrize(
    ("fields", "world", "per_node", "hpz", "raf"),
    [
        ({"stage": 3}, 4, 2, 1, True),
        ({"stage": 3, "hpz_partition_size": 0}, 4, 2, 2, 2),  # auto: ranks per node
        ({"stage": 3, "hpz_partition_size": 2}, 8, 4, 2, 2),
        ({"stage": 3, "hpz_partition_size": 0}, 4, 4, 1, True),  # one node: a group of everyone
        ({"stage": 3, "hpz_partition_size": 0}, 2, 1, 1, True),  # one rank per node
        ({"stage": 2}, 4, 2, 1, False),  # stage 2 keeps gathered params through backward
    ],
)
def test_hpz_and_reshard_after_forward(fields, world, per_node, hpz, raf):
    plan = resolve(ZeroConfig(**fields), _topo(world, per_node))
    assert plan.hpz_group == hpz and plan.reshard_after_forward == raf
    if fields.get("hpz_partition_size", 1) != 1 and hpz == 1:
        assert any(n.startswith("zeropp: hpZ is off") for n in plan.notes), plan.notes


def test_zeropp_switches_fall_back_on_one_node_and_say_why():
    config = ZeroConfig(stage=3, quantized_weights=True, quantized_gradients=True)
    one = resolve(config, _topo(2, 2))
    assert not one.quantized_weights and not one.quantized_gradients
    assert [n.split(" ")[1] for n in one.notes] == ["qwZ", "qgZ"]
    two = resolve(config, _topo(4, 2))
    assert two.quantized_weights and two.quantized_gradients and two.notes == ()
    forced = resolve(config.replace(quantized_gradients_on_single_node=True), _topo(2, 2))
    assert forced.quantized_gradients


def test_front_end_defaults_and_checkpoint_format():
    assert resolve(ZeroConfig(), _topo(2, 2)).gather_16bit is True
    assert resolve(ZeroConfig(), _topo(2, 2), gather_16bit_default=False).gather_16bit is False
    assert resolve(ZeroConfig(gather_16bit=True), _topo(2, 2), gather_16bit_default=False).gather_16bit is True
    assert resolve(ZeroConfig(stage=1), _topo(2, 2)).state_dict_type == "full"
    assert resolve(ZeroConfig(stage=3), _topo(2, 2)).state_dict_type == "sharded"
    plan = resolve(ZeroConfig(stage=3, offload_optimizer="cpu"), _topo(2, 2))
    assert isinstance(plan, Plan) and "offload optimizer=cpu param=none" in plan.describe()

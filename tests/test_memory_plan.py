"""The memory plan of an offloaded run ([Note: the memory plan]), streaming initialization
([Note: streaming initialization]) and gradient shards on NVMe ([Note: gradients on NVMe]).

References: the plan's rows against sizes computed by hand from the model; a run that
cannot fit is refused on every rank with the numbers, before any swap file exists; a
meta-initialized model streamed to NVMe holds the same weights, bit for bit, as the same
model materialized whole without offload, and trains to the same weights as plain stage 3
within the offload tests' tolerance; after backward every trainable gradient shard is a
view of the gradient swap file when the plan sends them there (and not otherwise).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

from tests._dist import run_ranks
from zeropp_strategy.config import ZeroConfig
from zeropp_strategy.engine import memory_plan
from zeropp_strategy.engine.memory_plan import RUNTIME_BYTES
from zeropp_strategy.engine.memory_plan import plan_memory as _plan_memory
from zeropp_strategy.plan import resolve
from zeropp_strategy.topology import Topology

pytestmark = pytest.mark.timeout(660)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

GiB = 2**30
TOL = 1e-5  # AdamW on the host vs on the device: a few ulps (tests/test_offload.py's bound)


def _net():
    from tests._models import Net

    with torch.device("meta"):
        return Net(width=64, depth=3)


def plan_memory(net, blocks, cfg: ZeroConfig, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """``memory_plan.plan_memory`` of ``cfg`` resolved for 2 ranks on one machine."""
    return _plan_memory(net, blocks, resolve(cfg, Topology.detect(2, 0, ranks_per_node=2)), **kwargs)


def _shard_bytes(params, world: int) -> int:
    return sum((math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) if p.dim() else 1) * 4 for p in params)


def test_frozen_int4_weights_are_planned_at_their_stored_size_and_get_no_gradients():
    """A LoRA-style run (a frozen base stored as int4, a few trainable parameters): the
    plan counts the base's shards as codes and block scales, and unsharded gradients only
    for what trains. It counted the base in fp32 with gradients and refused an 8B Llama
    that fits (33.5 GiB planned per rank against about 9 measured)."""
    net = _net()
    blocks = list(net.blocks)
    for p in net.parameters():
        p.requires_grad_(p.dim() < 2)  # the weight matrices frozen, biases and norms train
    cfg = ZeroConfig(stage=3, offload_optimizer="cpu", host_memory_budget_bytes=2 * GiB, quantize_frozen_weights=True,
                     frozen_weight_bits=4, quantize_min_elems=0, weight_quant_block_elems=32)
    plan = plan_memory(net, blocks, cfg, ranks_per_node=2, device=torch.device("cpu"), gather_bytes=4)
    host = dict(plan.host)
    params = list(net.parameters())
    quantized = [p for p in params if p.dim() >= 2 and p.shape[0] % 2 == 0]  # FSDP2 cannot pad int4 shards
    assert len(quantized) == 3  # a weight per block; the embedding (13 rows) and head (5 rows) stay dense
    codes = sum(math.ceil(p.shape[0] / 2) * (math.ceil(p[0].numel() / 2) + 4 * math.ceil(p[0].numel() / 32))
                for p in quantized)
    dense = [p for p in params if all(p is not q for q in quantized)]
    trainable = [p for p in params if p.requires_grad]
    assert host["parameter shards (in memory)"] == codes + _shard_bytes(dense, 2)
    # the gathered groups' codes (both ranks' shards) beside their dequantized weights: the
    # root group (no quantized weight) and 3 blocks in flight, plus one block's in the
    # all-gather buffer
    block_codes = max(math.ceil(p.shape[0] / 2) * (math.ceil(p[0].numel() / 2) + 4 * math.ceil(p[0].numel() / 32))
                      for p in quantized)
    assert host["gathered int8/int4 codes of those groups, and one group's in the all-gather buffer"] == (
        2 * (3 * block_codes + block_codes))
    assert host["gradient shards (in memory)"] == _shard_bytes(trainable, 2)
    block_trainable = sum(p.numel() for p in blocks[0].parameters() if p.requires_grad)
    root_trainable = sum(p.numel() for p in trainable) - 3 * block_trainable
    assert host["unsharded gradients in backward: the root group + 2 blocks"] == (root_trainable
                                                                                   + 2 * block_trainable) * 8


def _llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=4000, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_frozen_leaves_are_gathered_one_at_a_time_not_with_the_root():
    """A LoRA-shaped Llama (frozen embedding and head, each larger than a block; [Note:
    frozen leaves] in engine/wrap.py): the leaves are priced at the moments they are
    gathered ([Note: two moments of a step]), not both for the whole step in the root group:
    the head beside the one block prefetched in backward, with the activations; the
    embedding beside the two blocks the root prefetches, before any activation, as one more
    row that measured activations lower. A trainable, tied or small embedding stays in the
    root."""
    from zeropp_strategy.engine.memory_plan import ACTIVATIONS_ROW, EARLY_ROW
    from zeropp_strategy.engine.wrap import frozen_leaves, select_blocks

    net = _llama(tie=False)
    net.requires_grad_(False)
    blocks = select_blocks(net, wrap_modules=(), wrap_min_params=10**6)
    assert len(blocks) == 3
    embed, head = net.get_input_embeddings(), net.get_output_embeddings()
    assert frozen_leaves(net, blocks, min_params=1000) == [embed, head]
    assert frozen_leaves(net, blocks, min_params=10**6) == []
    cfg = ZeroConfig(stage=3, offload_optimizer="cpu", host_memory_budget_bytes=2 * GiB)
    block = sum(p.numel() for p in blocks[0].parameters())
    table = embed.weight.numel()  # the head's too (untied, same shape)
    root = sum(p.numel() for p in net.parameters()) - 3 * block - 2 * table

    plan = plan_memory(net, blocks, cfg, ranks_per_node=2, device=torch.device("cpu"), gather_bytes=4,
                       leaves=[embed, head])
    host = dict(plan.host)
    gathered = host["gathered parameters: the root group + its frozen head + the block prefetched in backward"]
    assert gathered == (root + table + block) * 4
    grads = host["unsharded gradients in backward: the root group + 2 blocks"]
    assert grads == 0  # nothing trains
    early = (root + table + 2 * block) * 4 - gathered  # the embedding's moment: one block more
    assert host[EARLY_ROW] == early > 0
    # measured activations: the blocks' moment gains them, the embedding's does not
    assert dict(plan.with_activations(early // 4).host)[EARLY_ROW] == early - early // 4
    measured = plan.with_activations(early)
    assert EARLY_ROW not in dict(measured.host) and measured.host[-1] == (ACTIVATIONS_ROW, early)
    assert measured.host_bytes == plan.host_bytes  # the larger moment is unchanged, not the sum
    assert plan.with_activations(3 * early).host_bytes == plan.host_bytes + 2 * early

    head.weight.requires_grad_(True)  # a trainable head stays in the root
    leaves = frozen_leaves(net, blocks, min_params=1000)
    assert leaves == [embed]
    plan = plan_memory(net, blocks, cfg, ranks_per_node=2, device=torch.device("cpu"), gather_bytes=4,
                       leaves=leaves)
    host = dict(plan.host)
    root_with_head = root + table
    gathered = host["gathered parameters: the root group + 3 blocks"]
    assert gathered == (root_with_head + 3 * block) * 4
    grads = host["unsharded gradients in backward: the root group + 2 blocks"]
    assert grads == table * 8  # the head's fp32 gradient and its gathered copy
    assert host.get(EARLY_ROW, 0) == max(0, (root_with_head + table + 2 * block) * 4 - gathered - grads)
    tied = _llama(tie=True)
    tied.requires_grad_(False)
    assert frozen_leaves(tied, select_blocks(tied, wrap_modules=(), wrap_min_params=10**6), min_params=1000) == []


def test_plan_rows_match_the_model(tmp_path):
    from zeropp_strategy.engine.wrap import select_blocks

    net = _net()
    blocks = list(net.blocks)
    assert select_blocks(net, wrap_modules=("Block",), wrap_min_params=1) == blocks
    params = list(net.parameters())
    shard = _shard_bytes(params, 2)
    block_full = sum(p.numel() for p in blocks[0].parameters())
    root_full = sum(p.numel() for p in params) - 3 * block_full
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = ZeroConfig(stage=3, offload_param=nvme, offload_optimizer=nvme, host_memory_budget_bytes=2 * GiB)
    plan = plan_memory(net, blocks, cfg, ranks_per_node=2, device=torch.device("cpu"), gather_bytes=4)
    host = dict(plan.host)
    assert host["runtime (Python, torch, the process group)"] == RUNTIME_BYTES
    assert host["gathered parameters: the root group + 3 blocks"] == (root_full + 3 * block_full) * 4
    assert host["optimizer state on NVMe: staging buffers"] == 4 * 64 * 2**20
    # The budget has room for the gradient shards: they stay in host memory, not on NVMe.
    assert not plan.grads_on_nvme
    assert [what for what in host if "(in memory" in what] == ["gradient shards (in memory: the budget has room for them)"]
    assert host["gradient shards (in memory: the budget has room for them)"] == shard
    assert host["pages queued for write-behind"] == shard  # the parameters only
    disk = {what: n for what, _, n in plan.disk}
    assert disk == {"parameter shards": shard, "optimizer state, AdamW": 2 * shard}
    assert plan.disk_bytes() == 3 * shard and plan.problems() == []
    assert f"{plan.host_bytes / GiB:.2f} GiB  total" in plan.describe()
    assert plan.disk_traffic_per_step() == (3 * shard + 2 * shard, shard + 2 * shard)

    # All in host memory: the shards, their gradients and AdamW's state grow with the model.
    cpu = plan_memory(net, blocks, ZeroConfig(stage=3, offload_param="cpu", offload_optimizer="cpu",
                                              host_memory_budget_bytes=GiB),
                      ranks_per_node=2, device=torch.device("cpu"), gather_bytes=4)
    rows = dict(cpu.host)
    assert rows["parameter shards (in memory)"] == shard and rows["gradient shards (in memory)"] == shard
    assert rows["optimizer state, AdamW (in memory)"] == 2 * shard and cpu.disk == ()


def test_gradients_go_to_nvme_only_when_memory_is_short(tmp_path):
    """[Note: gradients on NVMe]: a model whose gradient shards do not fit the budget beside
    everything else gets them on NVMe; the rows then grow with no part of the model."""
    with torch.device("meta"):
        from tests._models import Net

        net = Net(width=8192, depth=3)  # 805M parameters: a 1.6 GB fp32 shard per rank, past the write-behind cap
    blocks = list(net.blocks)
    shard = _shard_bytes(list(net.parameters()), 2)
    block_shard = _shard_bytes(list(blocks[0].parameters()), 2)
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}

    def plan(budget: int):
        cfg = ZeroConfig(stage=3, offload_param=nvme, offload_optimizer=nvme, host_memory_budget_bytes=budget)
        return plan_memory(net, blocks, cfg, ranks_per_node=2, device=torch.device("cpu"),
                           gather_bytes=4)

    roomy = plan(64 * GiB)
    assert not roomy.grads_on_nvme and roomy.problems() == []
    on_nvme = plan(2**20)  # nothing fits: the NVMe variant is the smaller one, and it is what gets refused
    assert on_nvme.grads_on_nvme and on_nvme.problems()
    assert on_nvme.host_bytes < roomy.host_bytes
    tight = plan(on_nvme.host_bytes)  # room for everything but the gradient shards
    assert tight.grads_on_nvme and tight.problems() == []
    host = dict(tight.host)
    assert host["gradient shards on NVMe: the group being reduced"] == 2 * block_shard
    assert not any("(in memory" in what for what in host)  # nothing grows with the model
    assert {what: n for what, _, n in tight.disk} == {"parameter shards": shard, "gradient shards": shard,
                                                        "optimizer state, AdamW": 2 * shard}
    assert roomy.host_bytes - tight.host_bytes == shard - 2 * block_shard  # what the gradients in memory cost


def test_plan_refuses_with_numbers_and_fix(tmp_path, monkeypatch):
    net = _net()
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    tight = ZeroConfig(stage=3, offload_param="cpu", offload_optimizer=nvme, host_memory_budget_bytes=2**20)
    plan = plan_memory(net, list(net.blocks), tight, ranks_per_node=2, device=torch.device("cpu"),
                       gather_bytes=4)
    (problem,) = plan.problems()
    assert "host memory" in problem and "over its budget of 0.00 GiB" in problem and "Fix:" in problem
    assert "host_memory_budget_bytes" in problem

    class Usage:
        free = 1000

    monkeypatch.setattr(memory_plan.shutil, "disk_usage", lambda path: Usage)
    roomy = ZeroConfig(stage=3, offload_param=nvme, offload_optimizer=nvme, host_memory_budget_bytes=8 * GiB)
    plan = plan_memory(net, list(net.blocks), roomy, ranks_per_node=2, device=torch.device("cpu"),
                       gather_bytes=4)
    (problem,) = plan.problems()
    assert f"under {tmp_path}" in problem and "2 rank(s)" in problem and "0.00 GiB free" in problem, problem
    assert "Fix:" in problem


def test_auto_budget_is_available_memory_over_local_ranks(monkeypatch):
    monkeypatch.setattr(memory_plan, "_meminfo_bytes", lambda key: 20 * GiB)
    monkeypatch.setattr(memory_plan, "_cgroup_free_bytes", lambda: None)
    budget, source = memory_plan.auto_budget_bytes(4)
    assert budget == int(20 * GiB * memory_plan.AUTO_FRACTION) // 4 and "MemAvailable" in source
    monkeypatch.setattr(memory_plan, "_cgroup_free_bytes", lambda: 8 * GiB)
    budget, source = memory_plan.auto_budget_bytes(2)
    assert budget == int(8 * GiB * memory_plan.AUTO_FRACTION) // 2 and "cgroup" in source


@pytest.mark.parametrize("value, exc", [(-1, ValueError), (100, ValueError), ("12GB", TypeError), (True, TypeError)])
def test_budget_field_is_checked(value, exc):
    with pytest.raises(exc, match=r"ZeroConfig\.host_memory_budget_bytes=.*Fix:"):
        ZeroConfig(host_memory_budget_bytes=value)


def test_activation_meter_counts_what_backward_keeps():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    measured = []
    meter = memory_plan.ActivationMeter(net, measured.append)
    x = torch.randn(5, 8)
    with torch.no_grad():  # a forward without gradients (a sanity check) is not measured
        net(x)
    assert measured == []
    net(x).sum().backward()
    # Saved for backward: the input (for the first weight's gradient) and the ReLU's output
    # (for the ReLU and the second weight's gradient; one storage). Not the weights.
    assert measured == [5 * 8 * 4 + 5 * 16 * 4]
    net(x).sum().backward()  # measured once: the hooks are gone
    assert measured == [5 * 8 * 4 + 5 * 16 * 4] and meter.nbytes == measured[0]

    frozen = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    frozen[2].requires_grad_(False)  # keeps its weight for the ReLU output's gradient: a parameter, not counted
    got = []
    memory_plan.ActivationMeter(frozen, got.append)
    frozen(x).sum().backward()
    assert got == [5 * 8 * 4 + 5 * 16 * 4]

    class Checkpointed(torch.nn.Module):  # a block under activation checkpointing inside the root
        def __init__(self) -> None:
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

        def forward(self, x):  # noqa: ANN001, ANN201
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    seen = []
    module = Checkpointed()
    memory_plan.ActivationMeter(module, seen.append)
    module(x).sum().backward()
    assert seen == [5 * 8 * 4]  # only the block's input is kept: the rest is recomputed in backward


def test_measured_activations_join_the_plan_and_warn_over_budget(tmp_path, caplog):
    plan = memory_plan.MemoryPlan(budget_bytes=GiB, budget_source="test", host=(("runtime", GiB // 2),), disk=())
    lines = []
    engine = type("E", (), {"memory_plan": plan, "rank": 0, "info": staticmethod(lines.append)})()
    memory_plan._measured(engine, plan, GiB // 4)
    assert engine.memory_plan.host[-1] == (memory_plan.ACTIVATIONS_ROW, GiB // 4)
    assert "0.25 GiB" in lines[0] and "0.75 GiB of its 1.00 GiB budget" in lines[0]
    with caplog.at_level("WARNING", logger=memory_plan.__name__):
        memory_plan._measured(engine, plan, GiB)
    assert "over it" in caplog.text and "Fix:" in caplog.text and len(lines) == 1


def _worker(rank: int, world: int, tmp: str) -> dict:
    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests._models import MetaInitModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.engine import core
    from zeropp_strategy.engine.state import full_model_state

    out: dict = {}
    nvme = {"device": "nvme", "nvme_path": f"{tmp}/nvme"}
    Path(nvme["nvme_path"]).mkdir(exist_ok=True)

    # 1. Cannot fit: refused on every rank, before any swap file exists.
    try:
        Trainer(strategy=ZeroPPStrategy(stage=3, offload_param=nvme, offload_optimizer=nvme,
                                        host_memory_budget_bytes=2**20), **trainer_kwargs(world, max_steps=1)
                ).fit(MetaInitModule())
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    out["swap_after_refusal"] = sorted(p.name for p in Path(nvme["nvme_path"]).iterdir())

    class Watch(Callback):
        def __init__(self) -> None:
            self.initial, self.grads_in_file, self.losses, self.swap_files = None, [], [], None

        def on_train_start(self, trainer, pl_module):  # noqa: ANN001
            self.initial = full_model_state(pl_module)

        def on_after_backward(self, trainer, pl_module):  # noqa: ANN001
            stores = trainer.strategy._session.engine.param_stores
            if stores:
                files = stores[0]._grads
                self.grads_in_file.append(all(
                    p.grad is not None and id(p) in files and p.grad.to_local().data_ptr() == files[id(p)][1].data_ptr()
                    for p in pl_module.parameters() if p.requires_grad and p.dim()))
                self.swap_files = sorted(f.name for f in Path(stores[0].swap_dir).iterdir())

        def on_train_batch_end(self, trainer, pl_module, outputs, *args):  # noqa: ANN001, ANN002
            self.losses.append(float(outputs["loss"]))

    # 2. Fits: streamed initialization equals the whole-model one; training equals stage 3.
    # With the default budget the gradients stay in host memory; without a budget (no
    # plan) they go to NVMe as well ([Note: gradients on NVMe]).
    runs = {}
    both = {"offload_param": nvme, "offload_optimizer": nvme}
    for name, fields in (("stage3", {}), ("nvme", both), ("nvme_grads", {**both, "host_memory_budget_bytes": None}),
                         ("nvme_params", {"offload_param": nvme})):
        seed_everything(0)
        watch = Watch()
        module = MetaInitModule()
        # Two micro-batches per step: the first runs under no_sync (FSDP2 keeps its gradients
        # unsharded, so the sharded .grad is still None after its backward), the second
        # reduce-scatters the sum.
        trainer = Trainer(strategy=ZeroPPStrategy(stage=3, **fields), callbacks=[watch],
                          **trainer_kwargs(world, max_steps=4, accumulate_grad_batches=2))
        trims: list[int] = []  # the engine's heap trims after a step (a planned run only)
        real_trim = core.trim_heap
        core.trim_heap = lambda: (trims.append(trainer.global_step), real_trim())
        try:
            trainer.fit(module)
        finally:
            core.trim_heap = real_trim
        out.setdefault("trims", {})[name] = len(trims)
        runs[name] = (watch, full_model_state(module))
        plan = trainer.strategy._session.engine.memory_plan if name == "nvme" else None
        if plan is not None:
            out["activations"] = dict(plan.host).get(memory_plan.ACTIVATIONS_ROW)
    ref, ref_final = runs["stage3"]
    for name in ("nvme", "nvme_grads", "nvme_params"):
        run, final = runs[name]
        out[name] = {"init_diff": max((ref.initial[k] - run.initial[k]).abs().max().item() for k in ref.initial),
                     "final_diff": max((ref_final[k] - final[k]).abs().max().item() for k in final),
                     "grads_in_file": run.grads_in_file, "swap_files": run.swap_files, "losses": run.losses}
    return out


def test_refused_on_every_rank_and_streamed_init_equals_whole(tmp_path):
    results = run_ranks(_worker, 2, (str(tmp_path),), timeout_s=600)
    for rank, out in enumerate(results):
        assert out["refused"] is not None, rank
        assert "ZeroConfig.host_memory_budget_bytes" in out["refused"] and "GiB" in out["refused"], out["refused"]
        assert "Fix:" in out["refused"] and "zeropp memory plan" in out["refused"], out["refused"]
        assert out["swap_after_refusal"] == [], out  # refused before the swap files
        # a run the plan holds to a budget gives the heap back after each of its 4 steps
        assert out["trims"] == {"stage3": 0, "nvme": 4, "nvme_grads": 0, "nvme_params": 4}, out["trims"]
        for name in ("nvme", "nvme_grads", "nvme_params"):
            assert out[name]["init_diff"] == 0.0, (name, out)
            assert out[name]["final_diff"] <= TOL, (name, out)
            assert all(math.isfinite(x) for x in out[name]["losses"]), (name, out)
        # The default budget has room for the gradients: in host memory, no gradient file.
        assert out["nvme"]["grads_in_file"] == [False] * 8, out
        assert out["nvme"]["swap_files"] == ["params.float32.swap"], out
        # No budget, no plan: the gradients rest on NVMe too, each a view of the gradient file.
        assert out["nvme_grads"]["grads_in_file"] == [False, True] * 4, out
        assert out["nvme_grads"]["swap_files"] == ["grads.float32.swap", "params.float32.swap"], out
        assert out["activations"] and out["activations"] > 0, out  # measured at the first step, in the plan
    assert shutil.disk_usage(tmp_path).free > 0

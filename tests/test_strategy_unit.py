"""Single-process checks of the strategy's surface: registry, config resolution,
precision translation, wrap policy, stage-1 partitioning and memory counting."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import zeropp_strategy
from zeropp_strategy import PRESETS, ZeroConfig, ZeroPPPrecision, ZeroPPStrategy
from zeropp_strategy.engine.stage1 import row_range
from zeropp_strategy.engine.wrap import select_blocks


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_registry_names_resolve_in_lightning(name, tmp_path, monkeypatch):
    from lightning.pytorch import Trainer

    monkeypatch.setenv("ZEROPP_NVME_PATH", str(tmp_path))  # zeropp_offload_nvme's swap directory
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroPPStrategy)
    assert trainer.strategy.stage == PRESETS[name]["stage"]
    if name.startswith("zeropp_offload"):
        cfg = trainer.strategy.config
        assert cfg.offload_param.device == cfg.offload_optimizer.device == ("nvme" if name.endswith("nvme") else "cpu")
        assert cfg.offload_optimizer.nvme_path == (str(tmp_path) if name.endswith("nvme") else None)


def test_nvme_preset_without_a_path_names_the_variable(monkeypatch):
    from lightning.pytorch import Trainer

    monkeypatch.delenv("ZEROPP_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match=r"offload_optimizer\.nvme_path=None.*export ZEROPP_NVME_PATH="):
        Trainer(strategy="zeropp_offload_nvme", accelerator="cpu", devices=2, logger=False)


def test_registry_names_resolve_in_pytorch_lightning():
    pl = pytest.importorskip("pytorch_lightning")
    trainer = pl.Trainer(strategy="zeropp_stage_2", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy).__name__ == "ZeroPPStrategy"
    assert isinstance(trainer.strategy, pl.strategies.ParallelStrategy)
    assert trainer.strategy.stage == 2


def test_front_ends_read_decisions_from_the_session_once_it_has_started():
    """stage and state_dict_type are the config's until setup, then the session plan's (the
    one place they are decided): a stand-in session with other answers shows which is read."""
    from types import SimpleNamespace

    from zeropp_strategy.fabric import ZeroPPFabricStrategy

    for strategy in (ZeroPPStrategy(stage=3), ZeroPPFabricStrategy(stage=3)):
        assert (strategy.stage, strategy.state_dict_type) == (3, "sharded")
        strategy._session = SimpleNamespace(stage=2, state_dict_type="full")
        assert (strategy.stage, strategy.state_dict_type) == (2, "full")


def test_config_sources(tmp_path):
    assert ZeroPPStrategy(stage=2).config.stage == 2
    assert ZeroPPStrategy(config={"stage": 1, "reduce_bucket_bytes": 4096}).config.reduce_bucket_bytes == 4096
    yml = tmp_path / "zero.yaml"
    yml.write_text("zero:\n  stage: 2\n  wrap_modules: [Block]\n")
    assert ZeroPPStrategy(config=yml).config.wrap_modules == ("Block",)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}))
    cfg = ZeroPPStrategy(config=ds, activation_checkpointing=True).config
    assert (cfg.stage, cfg.reduce_bucket_bytes, cfg.activation_checkpointing) == (3, 4000, True)


def test_bad_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"ZeroConfig\.stage=5 .*Fix"):
        ZeroPPStrategy(stage=5)
    with pytest.raises(ValueError, match="stag"):
        ZeroPPStrategy(stag=3)
    with pytest.raises(TypeError, match="ZeroPPStrategy\\(config\\)=42 is invalid"):
        ZeroPPStrategy(config=42)


def test_precision_translation():
    from lightning.pytorch import Trainer

    t = Trainer(strategy="zeropp_stage_3", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin, ZeroPPPrecision) and plugin.precision == "bf16-mixed"
    assert plugin.mp_policy().param_dtype == torch.bfloat16
    assert plugin.mp_policy().reduce_dtype == torch.float32
    t = Trainer(strategy="zeropp_stage_3", accelerator="cpu", devices=2, precision="bf16-true", logger=False)
    assert t.strategy.precision_plugin.mp_policy().param_dtype is None
    t = Trainer(strategy="zeropp_stage_1", accelerator="cpu", devices=2, plugins=[ZeroPPPrecision("16-mixed")],
                logger=False)
    assert t.strategy.precision_plugin.scaler is not None
    with pytest.raises(ValueError, match="64-true"):
        Trainer(strategy="zeropp_stage_1", accelerator="cpu", devices=2, precision="64-true")


def test_wrap_policy_hf_user_and_size():
    from transformers import LlamaForCausalLM

    from tests._models import Net, tiny_llama_config

    llama = LlamaForCausalLM(tiny_llama_config())
    blocks = select_blocks(llama, wrap_modules=(), wrap_min_params=10**9)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2
    net = Net()
    assert select_blocks(net, wrap_modules=("Block",), wrap_min_params=1) == list(net.blocks)
    # Size-based: each Block has ~5.6k params; with a 5k threshold each Block is a group.
    assert select_blocks(net, wrap_modules=(), wrap_min_params=5000) == list(net.blocks)
    with pytest.raises(ValueError, match=r"wrap_modules=\['Nope'\].*Fix.*one of \['Block'\]"):
        select_blocks(net, wrap_modules=("Nope",), wrap_min_params=1)


def test_wrap_modules_error_suggests_user_block_classes():
    """Under the strategy the policy sees our internal root wrapping the LightningModule:
    the fix names the model's blocks (Hugging Face's first), never the wrapper, the
    LightningModule, containers or leaf layers."""
    from lightning.pytorch import LightningModule
    from transformers import LlamaForCausalLM

    from tests._models import tiny_llama_config
    from zeropp_strategy.engine.fsdp import ShardedRoot

    class Lit(LightningModule):
        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(tiny_llama_config())

    with pytest.raises(ValueError) as info:
        select_blocks(ShardedRoot(Lit()), wrap_modules=("GPT2Block",), wrap_min_params=1)
    message = str(info.value)
    suggested = message.split("one of ", 1)[1]
    assert suggested.startswith("['LlamaDecoderLayer'"), message
    for internal in ("ShardedRoot", "'Lit'", "ModuleList", "'Linear'", "'Embedding'"):
        assert internal not in suggested, message
    with pytest.raises(ValueError, match="no composite submodule"):
        select_blocks(nn.Linear(2, 2), wrap_modules=("Block",), wrap_min_params=1)


def test_nested_wrap_matches_keep_outermost():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(3, 3))

    root = nn.Sequential(Outer(), Outer())
    got = select_blocks(root, wrap_modules=("Outer", "Sequential"), wrap_min_params=1)
    assert [type(m).__name__ for m in got] == ["Outer", "Outer"]


@pytest.mark.parametrize("dim0", [0, 1, 3, 5, 8, 37])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_row_ranges_partition_every_row_once(dim0, world):
    covered = []
    for r in range(world):
        lo, hi = row_range(dim0, r, world)
        assert 0 <= lo <= hi <= dim0
        covered.extend(range(lo, hi))
    assert covered == list(range(dim0))
    # Same layout as torch.chunk (what DTensor Shard(0) uses).
    if dim0:
        sizes = [c.shape[0] for c in torch.arange(dim0).chunk(world)]
        assert [hi - lo for lo, hi in (row_range(dim0, r, world) for r in range(world))][: len(sizes)] == sizes


def test_memory_stats_ddp_formula_single_process():
    from zeropp_strategy.engine.memory import memory_stats

    model = nn.Linear(10, 4)  # 44 params
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    m = memory_stats(model, [opt], stage=0, rank=0, world_size=1)
    assert m.num_params == 44
    assert m.param_bytes == m.predicted_param_bytes == 176
    assert m.grad_bytes == m.predicted_grad_bytes == 176
    assert m.predicted_optimizer_bytes == 352  # exp_avg + exp_avg_sq
    assert m.optimizer_bytes >= 352  # + the per-parameter `step` counters
    assert "formula MiB" in m.format()


def test_package_exports():
    for name in zeropp_strategy.__all__:
        assert getattr(zeropp_strategy, name) is not None
    assert isinstance(ZeroConfig().digest(), str)


def test_built_features_construct_without_a_warning():
    """Every setting the config accepts is implemented: none warns that it is ignored."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ZeroPPStrategy(stage=3, quantize_frozen_weights=True, offload_optimizer="cpu",
                       offload_param={"device": "nvme", "nvme_path": "."})
        ZeroPPStrategy(stage=3, offload_optimizer={"device": "nvme", "nvme_path": "."},
                       offload_param="cpu")


def test_precision_device_is_bound_late():
    """Lightning gives the plugin to the strategy before the devices are known."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "GradScaler is enabled, but CUDA is not available" on a CPU machine
        plugin = ZeroPPPrecision("16-mixed", device="cuda")
        plugin.bind("cpu")
    assert plugin.device == "cpu" and plugin.scaler._device == "cpu"


def test_hpz_fallback_message_names_the_real_reason():
    """With one rank per node (simulated_nodes equal to the world size) hpZ's group is one
    rank; the log must not call that 'a single node' right after reporting several nodes."""
    from types import SimpleNamespace

    import torch

    from zeropp_strategy import ZeroConfig
    from zeropp_strategy.engine.core import ZeroEngine
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    for per_node, want in ((1, "one rank per node"), (2, "a single node")):
        messages: list[str] = []
        topology = Topology(world_size=2, rank=0, ranks_per_node=per_node)
        engine = ZeroEngine(resolve(ZeroConfig(stage=3, hpz_partition_size=0), topology), topology=topology,
                            meshes=SimpleNamespace(intra_group=None, inter_group=None), ledger=None, precision=None,
                            device=torch.device("cpu"), info=messages.append)
        assert engine.reshard_after_forward() is True
        assert len(messages) == 1 and "hpZ is off" in messages[0] and want in messages[0], messages


def _reduce_worker(rank: int, world: int) -> dict:
    from zeropp_strategy.comm.control import set_default_ledger
    from zeropp_strategy.comm.ledger import CommKind, CommLedger
    from zeropp_strategy.fabric import ZeroPPFabricStrategy
    from zeropp_strategy.topology import Topology

    import warnings

    ledger = CommLedger(Topology.detect(world, rank))
    set_default_ledger(ledger)
    try:
        logged = ZeroPPStrategy().reduce(torch.tensor([float(rank), 2.0]), reduce_op="sum")
        summed = ZeroPPFabricStrategy().all_reduce(torch.tensor([1.0]), reduce_op="sum")
        with warnings.catch_warnings(record=True) as caught:  # Lightning's own all_gather warns under torch 2.13
            warnings.simplefilter("always")
            gathered = ZeroPPStrategy().all_gather(torch.tensor([rank, 10 + rank]))
            fabric_gathered = ZeroPPFabricStrategy().all_gather(torch.tensor([[float(rank)]]))
    finally:
        set_default_ledger(None)
    control = ledger.totals(CommKind.CONTROL)
    return {"logged": logged.tolist(), "summed": summed.tolist(), "calls": control.calls,
            "gathered": gathered.tolist(), "fabric_gathered": fabric_gathered.tolist(),
            "warnings": [str(w.message) for w in caught]}


def test_framework_reduces_are_booked_as_control():
    """Lightning's strategy.reduce (self.log(sync_dist=True)), Fabric's all_reduce and both
    front-ends' all_gather (self.all_gather) are collectives too: the ledger books them as
    CONTROL. The gather stacks every rank's tensor in rank order, as Lightning's does, and
    warns about nothing (Lightning's own takes torch's deprecated torch.distributed.nn path)."""
    from tests._dist import run_ranks

    for out in run_ranks(_reduce_worker, 2, init_process_group=True, timeout_s=120):
        assert out == {"logged": [1.0, 4.0], "summed": [2.0], "calls": 4, "gathered": [[0, 10], [1, 11]],
                       "fabric_gathered": [[[0.0]], [[1.0]]], "warnings": []}, out


def _evaluate_as_nccl_runs(rank: int, world: int) -> dict:
    """fit (validating after every step), validate and predict, with Lightning's loops taking the branch a NCCL run
    takes (torch.inference_mode unless the strategy says otherwise; under gloo they always
    use no_grad, which is why only a GPU showed the failure)."""
    import lightning.pytorch as L
    import lightning.pytorch.loops.utilities as loop_utils

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy.engine.state import full_model_state

    original = loop_utils._distributed_is_initialized
    loop_utils._distributed_is_initialized = lambda: False  # undone below: the rank's process is reused
    modes: set[bool] = set()

    class Recording(ParityModule):
        def validation_step(self, batch, batch_idx):
            modes.add(torch.is_inference_mode_enabled())
            return super().validation_step(batch, batch_idx)

        def predict_step(self, batch, batch_idx):
            modes.add(torch.is_inference_mode_enabled())
            return super().predict_step(batch, batch_idx)

    module = Recording()
    # validation after every step: training goes on after each evaluation, so an inference
    # tensor left in FSDP2's buffers would fail the next step
    trainer = L.Trainer(strategy="zeropp_stage_3", **trainer_kwargs(
        world, max_steps=3, limit_val_batches=2, val_check_interval=1))
    try:
        trainer.fit(module)
        val = trainer.validate(module, verbose=False)[0]["val_loss"]
        state = full_model_state(module)
        preds = trainer.predict(module)
    finally:
        loop_utils._distributed_is_initialized = original
    return {"val": float(val), "state": state, "preds": torch.cat(preds), "inference_mode": sorted(modes)}


def test_evaluation_of_a_sharded_model_runs_where_lightning_picks_inference_mode():
    """Seen on an H100 (NCCL): ``trainer.validate`` at stage 3 failed with "Inference tensors
    do not track version counter". The loops must evaluate under no_grad, and give what the
    consolidated model gives. (On the CPU an inference-mode forward of FSDP2 happens to
    work, so the test checks the mode the steps ran under, besides the results.)"""
    from tests._dist import run_ranks
    from tests._models import Net, dataset

    (got,) = run_ranks(_evaluate_as_nccl_runs, 1, timeout_s=180)
    net = Net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in got["state"].items()})
    x, y = dataset(n=24, seed=1).tensors
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(net(x[i:i + 4]), y[i:i + 4]) for i in range(0, 8, 4)]  # 2 batches
        px = dataset(n=16, seed=3).tensors[0]
        preds = net(px).argmax(-1)
    assert abs(got["val"] - float(torch.stack(losses).mean())) < 1e-5
    assert torch.equal(got["preds"], preds)
    assert got["inference_mode"] == [False], "evaluation of a sharded model ran under torch.inference_mode"

"""Meta-device builds by default at stages 2/3 (engine/meta_init.py, ZeroConfig.meta_init).

    pytest tests/test_meta_init.py -q

One process: a model built under ``meta_build`` and materialized equals the real build from
the same seed, bit for bit, and leaves the generator where the real build would; only the
modules holding meta tensors are materialized (a real backbone keeps its values); which
contexts build on meta (stage, ``empty_init``, ``meta_init``) for the Lightning and Fabric
strategies; ``from_pretrained`` inside gives the fix. Under the Trainer on 2 ranks (a module
built in ``configure_model`` is on meta at stages 2/3 and trains to DDP's parameters):
tests/test_parity.py::test_configure_model_builds_on_meta_at_stages_2_3.
"""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from torch import nn

from benchmarks.rss import status as rss
from tests._models import Net
from zeropp_strategy.engine.materialize import materialize
from zeropp_strategy.engine.meta_init import build_context, build_rng_state, meta_build
from zeropp_strategy.errors import UsageError
from zeropp_strategy.primitives import prefault


def _is_meta_here() -> bool:
    return torch.empty(1).is_meta


def test_a_meta_build_materializes_to_the_real_build_bit_for_bit() -> None:
    torch.manual_seed(7)
    real = Net()
    after_real = torch.get_rng_state()
    torch.manual_seed(7)
    with meta_build():
        model = Net()
    assert all(p.is_meta for p in model.parameters())
    assert build_rng_state(model) is not None
    torch.manual_seed(123)  # whatever ran in between: the build's own state is replayed
    materialize(model, torch.device("cpu"))
    for (name, got), want in zip(model.state_dict().items(), real.state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(torch.get_rng_state(), after_real)  # the generator where a real build leaves it
    assert build_rng_state(model) is None  # replayed once: a second materialization draws anew


def _populate_unsupported() -> bool:
    return sys.platform != "linux" or prefault([torch.empty(2**20)]) == 0


@pytest.mark.skipif(_populate_unsupported(), reason="needs madvise(MADV_POPULATE_WRITE): Linux 5.14 or later")
def test_prefault_maps_fresh_host_pages_and_keeps_values(monkeypatch) -> None:
    """[Note: prefaulting host shards] in primitives.py: the pages are resident after the one
    call, the values are those written before it, small and meta tensors are left alone; and
    materialize maps every host shard it allocates before filling it."""
    page = mmap.PAGESIZE
    # fresh anonymous pages for sure: a torch.empty could reuse memory the process touched before
    region = mmap.mmap(-1, 64 * 2**20)
    fresh = torch.frombuffer(region, dtype=torch.uint8)
    before = rss()["VmRSS"]
    assert prefault([fresh]) == 64 * 2**20
    assert rss()["VmRSS"] - before >= 60 * 2**20
    del fresh
    region.close()
    values = torch.randn(2**20)
    kept = values.clone()
    assert 4 * 2**20 - page <= prefault([values, values[10:]]) <= 4 * 2**20  # one storage, mapped once
    assert torch.equal(values, kept)
    assert prefault([torch.empty(100), torch.empty(2**20, device="meta")]) == 0
    mapped: list[int] = []
    monkeypatch.setattr("zeropp_strategy.engine.materialize.prefault", lambda ts: mapped.append(prefault(ts)))
    with meta_build():
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    materialize(model, torch.device("cpu"))
    assert mapped and mapped[0] >= 2 * 4 * 2**20 - 2 * page


def test_only_modules_holding_meta_tensors_are_materialized() -> None:
    torch.manual_seed(0)
    backbone = Net()  # built for real, e.g. loaded in __init__
    kept = {k: v.clone() for k, v in backbone.state_dict().items()}
    with meta_build():
        head = nn.Linear(5, 3)  # built in configure_model, on meta
    model = nn.Sequential(backbone, head)
    materialize(model, torch.device("cpu"))
    for k, v in kept.items():
        assert torch.equal(backbone.state_dict()[k], v), k
    assert not head.weight.is_meta and torch.isfinite(head.weight).all() and head.weight.abs().sum() > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("empty_init", [None, True, False])
@pytest.mark.parametrize("meta_init", [True, False])
def test_which_builds_are_on_meta(stage: int, empty_init: bool | None, meta_init: bool) -> None:
    with build_context(stage, meta_init, empty_init):
        on_meta = _is_meta_here()
    assert on_meta == (stage in (2, 3) and meta_init and empty_init is not False)


def test_the_lightning_and_fabric_strategies_build_on_meta_by_default() -> None:
    from zeropp_strategy import ZeroPPStrategy
    from zeropp_strategy.fabric import ZeroPPFabricStrategy

    for stage, expected in ((1, False), (2, True), (3, True)):
        with ZeroPPStrategy(stage=stage).tensor_init_context():  # what Lightning enters for configure_model
            assert _is_meta_here() is expected, stage
        with ZeroPPFabricStrategy(stage=stage).module_init_context():  # fabric.init_module()
            assert _is_meta_here() is expected, stage
    with ZeroPPStrategy(stage=3, meta_init=False).tensor_init_context():
        assert not _is_meta_here()
    with ZeroPPFabricStrategy(stage=3).module_init_context(empty_init=False):
        assert not _is_meta_here()


def test_from_pretrained_inside_a_meta_build_names_the_fix(tmp_path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(UsageError) as info, meta_build():
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert "meta_init=False" in str(info.value) and "zeropp_strategy.from_pretrained(path)" in str(info.value)
    assert not _is_meta_here()  # the context is left


def test_a_hugging_face_model_with_lora_built_on_meta_starts_from_its_base() -> None:
    """HF modules get the model's _init_weights; peft's adapters get peft's own init (B at
    zero), so the adapted model computes what its base computes."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    with meta_build():
        model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    materialize(model, torch.device("cpu"))
    lora_a = [p for n, p in model.named_parameters() if "lora_A" in n]
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_a) == len(lora_b) == 4
    assert all(b.abs().sum() == 0 for b in lora_b) and all(a.abs().sum() > 0 for a in lora_a)
    q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert abs(q.std().item() - cfg.initializer_range) < 0.005  # the model's own init, not nn.Linear's
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids=ids).logits
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    assert torch.equal(adapted, base)


def test_an_initialization_that_needs_the_base_weights_is_refused_on_meta() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64)
    with meta_build():
        model = LlamaForCausalLM(cfg)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    object.__setattr__(model.peft_config["default"], "init_lora_weights", "pissa")  # as a user would have asked
    with pytest.raises(UsageError, match="init_lora_weights='pissa'.*meta_init=False"):
        materialize(model, torch.device("cpu"))


def _gpt2(n_layer: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _same_init(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every tensor drawn from its real build's distribution: constants equal, random ones
    with the same mean and std (4,096 or more values each: 10% is about 9 standard errors)."""
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        if w.std() == 0:
            assert torch.equal(g, w), k
        else:
            assert abs(g.std().item() / w.std().item() - 1) < 0.1, (k, g.std().item(), w.std().item())
            assert abs(g.mean().item()) < 0.1 * w.std().item(), k


def test_a_hugging_face_init_that_reaches_into_submodules_runs_on_meta() -> None:
    """GPT-2's attention and MLP blocks redraw their c_proj weights with std 0.02 / sqrt(2
    n_layer) from the blocks' own _init_weights call ([Note: inits that reach into
    submodules] in engine/parent_init.py); a meta build used to keep the Conv1D's std 0.02."""
    torch.manual_seed(0)
    real = _gpt2()
    with meta_build():
        model = _gpt2()
    materialize(model, torch.device("cpu"))
    _same_init(dict(model.named_parameters()), dict(real.named_parameters()))
    scaled = model.transformer.h[1].mlp.c_proj.weight
    assert abs(scaled.std().item() - 0.02 / 2) < 0.001  # 0.02 / sqrt(2 * 2)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_a_parents_init_leaves_tensors_read_from_a_folder(tmp_path) -> None:
    """The second pass redraws only what this materialization drew: a GPT-2 streamed from a
    folder keeps the folder's c_proj weights."""
    from zeropp_strategy.engine.pretrained import from_pretrained

    torch.manual_seed(0)
    _gpt2().save_pretrained(tmp_path)
    with meta_build():
        model = from_pretrained(tmp_path, dtype=torch.float32)
    materialize(model, torch.device("cpu"))
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k


class _KeepingStore:
    """Stands in for offload_param='nvme''s ParamStore: records the groups handed to it."""

    def __init__(self) -> None:
        self.filled = 0

    def fill(self, group) -> None:
        self.filled += 1


def _sharded_gpt2_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for streaming in (False, True):
        torch.manual_seed(0)
        with meta_build():
            model = _gpt2()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        store = _KeepingStore() if streaming else None
        materialize(model, torch.device("cpu"), store=store)
        out["streaming" if streaming else "whole"] = {n: p.full_tensor() for n, p in model.named_parameters()}
        if store is not None:
            out["groups stored"] = store.filled
    return out


def test_on_a_cpu_mesh_the_parents_init_draws_whole_tensors_before_a_group_is_stored() -> None:
    """Sharded on 2 ranks, with the model's groups materialized all at once and streamed one
    group at a time (as offload_param='nvme' does): the same distributions as the real build,
    each redrawn c_proj drawn whole (its two ranks' halves differ) before its group is stored,
    and the two ways the same draws, bit for bit."""
    from tests._dist import run_ranks

    per_rank = run_ranks(_sharded_gpt2_worker, 2, (), timeout_s=120, init_process_group=True)
    torch.manual_seed(0)
    want = dict(_gpt2().named_parameters())
    for out in per_rank:
        assert out["groups stored"] == 3  # two blocks and the root
        for how in ("whole", "streaming"):
            _same_init(out[how], want)
            w = out[how]["transformer.h.0.attn.c_proj.weight"]
            assert not torch.equal(w[:32], w[32:]), how
    for how in ("whole", "streaming"):
        for k, v in per_rank[0][how].items():
            assert torch.equal(v, per_rank[1][how][k]), (how, k)
    for k, v in per_rank[0]["whole"].items():
        assert torch.equal(v, per_rank[0]["streaming"][k]), k

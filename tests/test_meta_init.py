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

import pytest
import torch
from torch import nn

from tests._models import Net
from zeropp_strategy.engine.materialize import materialize
from zeropp_strategy.engine.meta_init import build_context, build_rng_state, meta_build
from zeropp_strategy.errors import UsageError


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

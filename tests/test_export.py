"""Exporting a live sharded model (checkpoint/export.py): the merged folder, streamed, and
the LoRA adapters alone.

    pytest tests/test_export.py -q

A published folder is loaded with ``zeropp_strategy.from_pretrained`` in
``configure_model``, LoRA adapters are put on it (peft), the Trainer trains a few steps on
2 gloo ranks at stages 1 and 3 (and stage 3 with an int4 frozen base), then every rank
calls ``export_pretrained`` and ``export_adapters``. The references are peft's own: the
gathered state loaded into a CPU ``PeftModel`` and ``merge_and_unload`` (the merged folder
must equal it bit for bit), and ``PeftModel.from_pretrained`` of the adapter folder (its
adapters must equal the trained ones bit for bit, its logits the merged model's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from zeropp_strategy.errors import UsageError

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"], "lora_dropout": 0.0}


def _save(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    return folder


def _worker(rank: int, world: int, folder: str, out_root: str, variants: dict) -> dict:
    import lightning.pytorch as L
    from peft import LoraConfig, get_peft_model

    import zeropp_strategy
    from tests._models import trainer_kwargs
    from zeropp_strategy.engine.state import full_model_state

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:  # docs/pretrained.md, "Export"
            if self.model is None:
                base = zeropp_strategy.from_pretrained(folder, dtype=torch.float32)
                self.model = get_peft_model(base, LoraConfig(**LORA))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.Adam((p for p in self.parameters() if p.requires_grad), lr=1e-2)

        def train_dataloader(self):
            ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)

    out = {}
    for name, config in variants.items():
        torch.manual_seed(0)
        module = Module()
        trainer = L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(**config), **trainer_kwargs(world, max_steps=3))
        trainer.fit(module)
        state = full_model_state(module.model)
        merged = zeropp_strategy.export_pretrained(module.model, f"{out_root}/{name}/merged", max_shard_bytes=20_000)
        adapters = zeropp_strategy.export_adapters(module.model, f"{out_root}/{name}/adapters")
        failed = None
        try:  # a failure on rank 0 before it reads a weight: every rank still gathers, and raises
            zeropp_strategy.export_pretrained(module.model, f"{out_root}/{name}/bad", max_shard_bytes=0)
        except (ValueError, RuntimeError) as e:
            failed = type(e).__name__
        out[name] = {"state": state, "merged": str(merged), "adapters": str(adapters), "failed": failed}
    return out


VARIANTS = {
    "stage1": {"stage": 1},
    "stage3": {"stage": 3},
    "stage3_int4": {"stage": 3, "quantize_frozen_weights": True, "frozen_weight_bits": 4, "quantize_min_elems": 0},
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    folder = _save(root / "base")
    per_rank = run_ranks(_worker, 2, (str(folder), str(root / "out"), VARIANTS), timeout_s=300)
    return folder, per_rank


def _peft_reference(folder: Path, state: dict[str, torch.Tensor]):
    """The trained model rebuilt on the CPU by transformers and peft from the gathered state."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), LoraConfig(**LORA))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_merged_export_equals_peft_merge_and_unload(exported, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    folder, per_rank = exported
    result = per_rank[0][variant]
    # LoRA built on meta and sharded: peft's init over whole tensors, B at zero, not garbage
    assert all(torch.isfinite(v).all() for v in result["state"].values()), variant
    want = _peft_reference(folder, result["state"]).merge_and_unload().state_dict()
    files = sorted(p.name for p in Path(result["merged"]).iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2, files
    got = AutoModelForCausalLM.from_pretrained(result["merged"], dtype=torch.float32).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (variant, k)
    assert not any("lora" in k for k in got)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q], base[q])  # the adapters were trained and merged in


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_adapter_export_loads_with_peft(exported, variant: str) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, per_rank = exported
    result = per_rank[0][variant]
    assert {p.name for p in Path(result["adapters"]).iterdir()} >= {"adapter_model.safetensors", "adapter_config.json"}
    trained = result["state"]
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if variant == "stage3_int4":  # the run's base is the int4 one: give peft the same base
        dense = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
                 for k, v in trained.items() if "lora_" not in k}
        missing, unexpected = base.load_state_dict(dense, strict=False)
        assert not missing and not unexpected, (missing, unexpected)
    loaded = PeftModel.from_pretrained(base, result["adapters"])
    lora = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert lora and all(torch.equal(v, trained[k]) for k, v in lora.items())
    merged = AutoModelForCausalLM.from_pretrained(result["merged"], dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_failure_on_rank_0_raises_on_every_rank_and_leaves_nothing(exported) -> None:
    _, per_rank = exported
    for rank, out in enumerate(per_rank):
        for variant, result in out.items():
            assert result["failed"] == ("ValueError" if rank == 0 else "RuntimeError"), (rank, variant)
            assert not Path(result["merged"]).with_name("bad").exists()


def _tiny_peft(**lora):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, intermediate_size=48, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=2, target_modules=["q_proj"], **lora))


def test_what_a_streamed_merge_cannot_do_is_refused_by_name(tmp_path: Path) -> None:
    from zeropp_strategy import export_adapters, export_pretrained

    with pytest.raises(UsageError, match=r"q_proj.*DoRA.*Fix: export the adapters alone"):
        export_pretrained(_tiny_peft(use_dora=True), tmp_path / "merged")
    with pytest.raises(UsageError, match="carries no peft adapters"):
        export_adapters(_tiny_peft().merge_and_unload(), tmp_path / "adapters")
    with pytest.raises(UsageError, match="adapter='other' is not one of"):
        export_adapters(_tiny_peft(), tmp_path / "adapters", adapter="other")
    assert not any(tmp_path.iterdir())  # nothing written

"""Published models loaded shard by shard (engine/pretrained.py, ``zeropp_strategy.from_pretrained``).

    pytest tests/test_pretrained.py -q

Against transformers' own ``from_pretrained`` of the same folder, bit for bit: one process
(the skeleton on meta, materialized), and under the Trainer at stages 1/2/3 on 2 gloo ranks
(the model built in ``configure_model``: on meta at stages 2/3, every rank's shard read from
the files); sharded (index + several files) and single-file folders, tied and untied
embeddings, bf16 files into fp32 parameters. Bad folders: one ``UsageError`` each, naming
the folder, the file and the tensor, raised where the skeleton is built (on every rank).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from zeropp_strategy.engine.materialize import materialize
from zeropp_strategy.engine.meta_init import meta_build
from zeropp_strategy.engine.pretrained import from_pretrained
from zeropp_strategy.errors import UsageError


def _save(folder: Path, *, tied: bool, shard: str | None, dtype: torch.dtype = torch.bfloat16) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def _reference(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tied,shard", [(False, None), (True, "40KB")], ids=["single-untied", "sharded-tied"])
def test_the_streamed_skeleton_equals_from_pretrained(tmp_path: Path, tied: bool, shard: str | None) -> None:
    folder = _save(tmp_path / "m", tied=tied, shard=shard)
    assert (folder / "model.safetensors.index.json").exists() == (shard is not None)
    with meta_build():
        model = from_pretrained(folder, dtype=torch.float32)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"))
    want = _reference(folder)
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), k
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_outside_a_meta_build_it_is_transformers_own(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", tied=False, shard=None)
    model = from_pretrained(folder, dtype=torch.float32)
    assert not any(p.is_meta for p in model.parameters())
    for k, v in _reference(folder).items():
        assert torch.equal(model.state_dict()[k], v), k


def _break(folder: Path, how: str) -> str:
    """Damage ``folder`` one way; return what the error must name."""
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    if how == "no config":
        (folder / "config.json").unlink()
        return "has no config.json"
    if how == "missing shard":
        (folder / first).unlink()
        return f"{first}, named by model.safetensors.index.json, is missing"
    if how == "truncated shard":
        data = (folder / first).read_bytes()
        (folder / first).write_bytes(data[: len(data) // 2])
        return f"{first}"
    tensors = load_file(folder / first)
    name = sorted(tensors)[0]
    if how == "wrong shape":
        tensors[name] = tensors[name][..., :1].contiguous()
        save_file(tensors, folder / first, metadata={"format": "pt"})
        return f"{name}: "
    if how == "unexpected key":
        tensors["model.extra.weight"] = torch.zeros(2)
        index["weight_map"]["model.extra.weight"] = first
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        save_file(tensors, folder / first, metadata={"format": "pt"})
        return "model.extra.weight"
    assert how == "missing key"
    del tensors[name]
    del index["weight_map"][name]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(tensors, folder / first, metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("how", ["no config", "missing shard", "truncated shard", "wrong shape", "unexpected key",
                                 "missing key"])
def test_a_bad_folder_is_one_line_naming_file_and_tensor(tmp_path: Path, how: str) -> None:
    folder = _save(tmp_path / "m", tied=False, shard="40KB")
    named = _break(folder, how)
    with pytest.raises(UsageError) as info, meta_build():
        from_pretrained(folder)
    text = str(info.value)
    assert named in text and str(folder) in text and "Fix:" in text and "\n" not in text, text


def test_rows_are_read_as_the_file_holds_them_and_a_bad_header_is_one_line(tmp_path: Path) -> None:
    """``PretrainedFolder`` reads the safetensors header itself: row ranges (empty ones too),
    0-dim and unsigned tensors as safetensors gives them; a header that is not a table, a
    dtype it does not read, offsets outside the file: one line naming the file (and the
    tensor where there is one), when the folder is opened, not at the first read."""
    import struct
    import warnings

    from safetensors.torch import load_file, save_file

    from zeropp_strategy.engine.pretrained import PretrainedFolder

    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tensors = {"a": torch.arange(12, dtype=torch.float32).view(3, 4).to(torch.bfloat16), "e": torch.zeros(0, 4),
               "s": torch.tensor(3.5), "u": torch.arange(4).to(torch.uint32)}
    save_file(tensors, folder / "model.safetensors")
    want = load_file(folder / "model.safetensors")
    files = PretrainedFolder(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a read-only mapping, read without a warning
        assert torch.equal(files.read("a", 1, 3), want["a"][1:3])
        assert files.read("a", 2, 2).shape == (0, 4) and files.read("e", 0, 0).shape == (0, 4)
        assert torch.equal(files.read("s", 0, 0), want["s"]) and torch.equal(files.read("u", 0, 4), want["u"])
    files.close()

    def refused(header: object) -> str:
        raw = json.dumps(header).encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(64))
        with pytest.raises(UsageError) as info:
            PretrainedFolder(folder)
        text = str(info.value)
        assert "model.safetensors" in text and "Fix:" in text and "\n" not in text, text
        return text

    assert "cannot be read" in refused([1, 2])
    assert "tensor 'x' has dtype F4" in refused({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})
    assert "tensor 'x'" in refused({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}})
    assert "tensor 'x'" in refused({"x": {"dtype": "F32", "shape": [200], "data_offsets": [0, 800]}})


# -- under the Trainer, 2 ranks ------------------------------------------------------------------


def _fit_worker(rank: int, world: int, folder: str, stages: tuple) -> dict:
    import lightning.pytorch as L

    import zeropp_strategy
    from tests._models import trainer_kwargs
    from zeropp_strategy.engine.pretrained import _SOURCES
    from zeropp_strategy.engine.state import full_model_state

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None
            self.on_meta = None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = zeropp_strategy.from_pretrained(folder, dtype=torch.float32)
                self.on_meta = all(p.is_meta for p in self.model.parameters())
                self.model.model.layers.requires_grad_(False)  # frozen blocks (int4 on load where asked), trained embeddings

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0]).logits.float().mean() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)

    out = {}
    for stage in stages:
        module = Module()
        strategy = stage if isinstance(stage, str) else zeropp_strategy.ZeroPPStrategy(**stage)
        trainer = L.Trainer(strategy=strategy, **trainer_kwargs(world, max_steps=1))
        trainer.fit(module)
        state = full_model_state(module)
        key = stage if isinstance(stage, str) else f"meta_init={stage['meta_init']}"
        folders = {id(src[0]): src[0] for m in module.model.modules() if (src := _SOURCES.get(m)) is not None}
        out[key] = {"on_meta": module.on_meta, "state": {k.removeprefix("model."): v for k, v in state.items()},
                    "files_open": sorted(len(f._files) + (f._last is not None) for f in folders.values()),
                    "read_from": len(folders)}
    return out


def test_under_the_trainer_every_stage_loads_what_from_pretrained_gives(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", tied=True, shard="40KB")
    want = _reference(folder)
    stages = ("zeropp_stage_1", "zeropp_stage_2", "zeropp_stage_3")
    per_rank = run_ranks(_fit_worker, 2, (str(folder), stages), timeout_s=240)
    for rank, out in enumerate(per_rank):
        for stage in stages:
            assert out[stage]["on_meta"] == (stage != "zeropp_stage_1"), (rank, stage)
            # read into the shards, the files are unmapped and no page of them is held
            assert out[stage]["read_from"] == (stage != "zeropp_stage_1"), (rank, stage)
            assert out[stage]["files_open"] == [0] * out[stage]["read_from"], (rank, stage, out[stage])
            got = out[stage]["state"]
            assert set(want) <= set(got), (stage, sorted(set(want) - set(got))[:3])
            for k, v in want.items():
                assert torch.equal(got[k], v), (rank, stage, k)


def _rank0_worker(rank: int, world: int, folder: str) -> dict:
    import lightning.pytorch as L
    from lightning.fabric import Fabric

    import zeropp_strategy
    from tests._models import trainer_kwargs

    out = {}
    # Lightning: init_module(empty_init=True) at stage 1; the values come with DDP's broadcast
    trainer = L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(stage=1), **trainer_kwargs(world, max_steps=1))
    with trainer.init_module(empty_init=True):
        model = from_pretrained(folder)  # the folder's bf16, as transformers 5 keeps it
    out["lightning_built"] = {"meta": all(p.is_meta for p in model.parameters()), "training": model.training,
                              "dtype": str(next(model.parameters()).dtype)}

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0]).logits.float().mean() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 4, dtype=torch.long)),
                                               batch_size=1)

    trainer.fit(Module())
    out["lightning"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["lightning_tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    # Fabric: the body only (get_decoder(), as RewardModule takes it), in fp32 from the bf16 files
    fabric = Fabric(strategy="zeropp_stage_1", accelerator="cpu", devices=world)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        body = from_pretrained(folder, dtype=torch.float32).get_decoder()
    out["fabric_built_meta"] = all(p.is_meta for p in body.parameters())
    body = fabric.setup(body)
    out["fabric"] = {k: v.detach().clone() for k, v in body.module.state_dict().items()}
    return out


def test_stage_1_with_empty_init_reads_on_rank_0_only_and_every_rank_ends_with_the_files(tmp_path: Path) -> None:
    """[Note: stage-1 load on rank 0]: with init_module(empty_init=True) the other ranks build
    on the meta device (they read nothing), as rank 0's model would be (eval mode, dtype),
    and after the set-up hold the files' values, tied weights tied."""
    folder = _save(tmp_path / "m", tied=True, shard="40KB")
    from transformers import AutoModelForCausalLM

    bf16 = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}
    fp32 = _reference(folder)
    zero, one = run_ranks(_rank0_worker, 2, (str(folder),), timeout_s=240)
    assert not zero["lightning_built"]["meta"] and one["lightning_built"]["meta"] and one["fabric_built_meta"]
    assert zero["lightning_built"]["training"] == one["lightning_built"]["training"] is False
    assert zero["lightning_built"]["dtype"] == one["lightning_built"]["dtype"] == "torch.bfloat16"
    for out in (zero, one):
        assert out["lightning_tied"]
        assert out["lightning"].keys() == bf16.keys()
        for k, v in bf16.items():
            assert out["lightning"][k].dtype == v.dtype and torch.equal(out["lightning"][k], v), k
        for k, v in out["fabric"].items():
            assert v.dtype == torch.float32 and torch.equal(v, fp32["model." + k]), k


def test_int4_on_load_equals_quantizing_the_dense_load(tmp_path: Path) -> None:
    """quantize_frozen_weights with a streamed load: each rank's rows go from the file
    straight into int4 codes (the dense base never exists on a rank); the codes equal those
    of the dense load quantized after sharding (meta_init=False), read back dequantized."""
    folder = _save(tmp_path / "m", tied=False, shard="40KB")
    config = {"stage": 3, "quantize_frozen_weights": True, "frozen_weight_bits": 4, "quantize_min_elems": 0}
    variants = ({**config, "meta_init": True}, {**config, "meta_init": False})
    per_rank = run_ranks(_fit_worker, 2, (str(folder), variants), timeout_s=240)
    want = _reference(folder)
    for out in per_rank:
        streamed, dense = out["meta_init=True"], out["meta_init=False"]
        assert streamed["on_meta"] and not dense["on_meta"]
        for k in dense["state"]:
            assert torch.equal(streamed["state"][k], dense["state"][k]), k
        q = "model.layers.0.mlp.up_proj.weight"
        assert not torch.equal(streamed["state"][q], want[q])  # quantized: not the file's values
        assert torch.allclose(streamed["state"][q], want[q], atol=0.02)


def _accelerate_worker(rank: int, world: int, folder: str) -> dict:
    import zeropp_strategy
    from zeropp_strategy.accelerate import ZeroPPAccelerator
    from zeropp_strategy.engine.meta_init import meta_build

    accelerator = ZeroPPAccelerator(zero_config={"stage": 3})
    with meta_build():  # docs/pretrained.md, "Accelerate"
        model = zeropp_strategy.from_pretrained(folder, dtype=torch.float32)
    on_meta = all(p.is_meta for p in model.parameters())
    model = accelerator.prepare(model)
    state = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return {"on_meta": on_meta, "state": state if rank == 0 else {}}


def test_accelerate_prepare_fills_a_streamed_skeleton(tmp_path: Path) -> None:
    folder = _save(tmp_path / "m", tied=True, shard="40KB")
    per_rank = run_ranks(_accelerate_worker, 2, (str(folder),), timeout_s=180, env={"ACCELERATE_USE_CPU": "true"})
    assert all(out["on_meta"] for out in per_rank)
    got = per_rank[0]["state"]
    for k, v in _reference(folder).items():
        assert torch.equal(got[k], v), k

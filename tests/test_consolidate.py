"""`zeropp consolidate`: sharded checkpoint -> one Lightning file, or a Hugging Face folder.

    python -m pytest tests/test_consolidate.py -q

Single process. The fixture trains a tiny LlamaForCausalLM one AdamW step with a plain
Trainer, saves the ordinary checkpoint (the reference: what strategy="ddp" writes), and
rewrites it by hand in the zeropp sharded format v1 (DCP files + zeropp_meta.pt), as the
strategy does from rank 0. Consolidating must give back the reference, key for key and
bit for bit; exporting must give a folder that from_pretrained loads to the same logits.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule, Trainer
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from zeropp_strategy.checkpoint.consolidate import consolidate, parse_size
from zeropp_strategy.cli import main as cli_main

VOCAB = 61
META = "zeropp_meta.pt"


def llama_config(tie: bool = False) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip


class LitLlama(LightningModule):
    """A causal LM under attribute ``model`` (fqns ``model.model.layers...``), plus state that
    is not the HF model's: a parameter that never gets a gradient (so it has no optimizer
    state) and an integer buffer."""

    def __init__(self, tie: bool = False, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(llama_config(tie))
        self.unused = nn.Parameter(torch.zeros(3))
        self.register_buffer("seen", torch.tensor(0))

    def training_step(self, batch, batch_idx):
        (ids,) = batch  # (B, T)
        self.seen += 1
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        # two groups, so a parameter's index runs across groups
        matrices = [p for p in self.parameters() if p.ndim >= 2]
        others = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}], lr=self.hparams.lr
        )

    def train_dataloader(self):
        ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=4)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        folder
    )


def hf_entry(module: LitLlama) -> dict[str, Any]:
    return {"prefix": "model.", "architecture": type(module.model).__name__, "config": module.model.config.to_dict()}


def write_sharded(ref: dict[str, Any], module: LightningModule, optimizers: list, folder: Path,
                  extra_tensors: dict[str, Any] | None = None, **zeropp: Any) -> None:
    """``ref`` (a DDP-style checkpoint) rewritten in the zeropp sharded format v1."""
    names = {id(p): n for n, p in module.named_parameters()}
    optim_tensors: dict[str, Any] = {}
    optimizer_states = []
    for i, (opt, osd) in enumerate(zip(optimizers, ref["optimizer_states"])):
        fqns = [names[id(p)] for g in opt.param_groups for p in g["params"]]
        optimizer_states.append({
            "param_groups": [{**g, "params": [fqns[j] for j in g["params"]]} for g in osd["param_groups"]],
            "state_meta": {
                fqns[j]: {k: "__tensor__" if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                for j, s in osd["state"].items()
            },
        })  # fmt: skip
        optim_tensors[str(i)] = {
            fqns[j]: {k: v for k, v in s.items() if isinstance(v, torch.Tensor)} for j, s in osd["state"].items()
        }
    meta = {k: v for k, v in ref.items() if k != "state_dict"}
    meta["optimizer_states"] = optimizer_states
    meta["zeropp"] = {
        "format": "zeropp-sharded", "version": 1, "stage": 3, "world_size": 2, "config": {"stage": 3},
        "hf": [hf_entry(module)], "tokenizer_dir": None, **zeropp,
    }  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": dict(ref["state_dict"]), "optim": optim_tensors, **(extra_tensors or {})},
                 checkpoint_id=folder, no_dist=True)
    torch.save(meta, folder / META)


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure, keys, types and values; tensors bit for bit, dtype included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(module, optimizer, reference checkpoint dict, sharded checkpoint dir), after one AdamW step."""
    root = tmp_path_factory.mktemp("consolidate")
    module = LitLlama()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    trainer.save_checkpoint(root / "ddp.ckpt")
    ref = torch.load(root / "ddp.ckpt", weights_only=True)
    sharded = root / "sharded"
    sharded.mkdir()
    write_tokenizer(sharded / "tokenizer")
    write_sharded(ref, module, trainer.optimizers, sharded, tokenizer_dir="tokenizer")
    module.eval()
    return module, trainer.optimizers[0], ref, sharded


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits  # (2, 9, VOCAB)


# -- (a) one Lightning file ---------------------------------------------------------------


def test_full_checkpoint_is_what_ddp_saves(trained, tmp_path):
    module, optimizer, ref, sharded = trained
    out = consolidate(sharded, tmp_path / "full.ckpt")
    assert out == tmp_path / "full.ckpt" and out.is_file()
    assert not list(tmp_path.glob("*.tmp-*"))
    full = torch.load(out, weights_only=True)

    zeropp = full.pop("zeropp")
    assert zeropp["format"] == "zeropp-consolidated" and zeropp["hf"][0]["prefix"] == "model."
    assert_same(full, ref, "checkpoint")  # every Lightning key, in the same order
    assert_same(full["state_dict"], module.state_dict(), "state_dict")
    assert_same(full["optimizer_states"][0], optimizer.state_dict(), "optimizer")
    # the parameter with no gradient has an index but no state
    assert len(full["optimizer_states"][0]["state"]) == sum(len(g["params"]) for g in optimizer.param_groups) - 1


def test_kept_errors_of_error_feedback_stay_out_of_the_full_file(trained, tmp_path):
    """A sharded checkpoint of a run with qgZ error feedback holds every rank's kept errors;
    they are per-rank training state, which a one-file checkpoint does not hold: consolidate
    leaves them out (and writes the same file as without them)."""
    module, optimizer, ref, _ = trained
    sharded = tmp_path / "with_errors"
    kept = {"qgz_error": {"model": {"rank0.0": torch.ones(64), "rank1.0": torch.full((64,), 2.0)}}}
    write_sharded(ref, module, [optimizer], sharded, extra_tensors=kept,
                  qgz_error={"model": {"layout": [2, 2, 1], "reductions": [3]}})
    full = torch.load(consolidate(sharded, tmp_path / "full.ckpt"), weights_only=True)
    assert "qgz_error" not in full.pop("zeropp")
    assert_same(full, ref, "checkpoint")


def test_full_checkpoint_loads_into_a_fresh_module_and_optimizer(trained, tmp_path):
    module, optimizer, _, sharded = trained
    out = consolidate(sharded, tmp_path / "full.ckpt")
    full = torch.load(out, weights_only=True)

    fresh = LitLlama(lr=0.5)
    fresh.load_state_dict(full["state_dict"])
    assert_same(fresh.state_dict(), module.state_dict())
    opt = fresh.configure_optimizers()
    opt.load_state_dict(full["optimizer_states"][0])
    assert_same(opt.state_dict(), optimizer.state_dict())

    restored = LitLlama.load_from_checkpoint(out)
    assert restored.hparams.lr == module.hparams.lr
    assert_same(restored.state_dict(), module.state_dict())


def test_dtype_casts_model_weights_only(trained, tmp_path):
    module, optimizer, _, sharded = trained
    full = torch.load(consolidate(sharded, tmp_path / "bf16.ckpt", dtype="bf16"), weights_only=True)
    for key, value in module.state_dict().items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert_same(full["state_dict"][key], want, key)
    assert_same(full["optimizer_states"][0], optimizer.state_dict())


# -- (b) Hugging Face folder ----------------------------------------------------------------


def test_hf_folder_loads_with_from_pretrained(trained, tmp_path):
    module, _, _, sharded = trained
    out = consolidate(sharded, tmp_path / "hf", hf=True)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert "model.safetensors.index.json" not in names
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(module.model.state_dict())  # prefix stripped, `unused`/`seen` left out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert torch.equal(logits(model), logits(module.model))
    ids = torch.tensor([[1, 5, 7, 9]])
    assert model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False).shape == (1, 7)

    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out)("w5 w7")["input_ids"] == [5, 7]


def test_hf_sharded_into_several_files(trained, tmp_path):
    module, _, _, sharded = trained
    out = consolidate(sharded, tmp_path / "hf", hf=True, max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(module.model.state_dict())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in module.model.state_dict().values())
    for name in files:  # every shard within the limit, unless it holds one bigger tensor alone
        with safe_open(out / name, "pt") as f:
            keys = list(f.keys())
            assert len(keys) == 1 or sum(f.get_tensor(k).nbytes for k in keys) <= 20_000
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(module.model))


def test_hf_dtype_bf16(trained, tmp_path):
    module, _, _, sharded = trained
    out = consolidate(sharded, tmp_path / "hf", hf=True, dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert_same(model.state_dict(), {k: v.to(torch.bfloat16) for k, v in module.model.state_dict().items()})


# -- (c) a full checkpoint as input -------------------------------------------------------------


def test_hf_from_a_consolidated_file(trained, tmp_path):
    module, _, _, sharded = trained
    full = consolidate(sharded, tmp_path / "full.ckpt")
    out = consolidate(full, tmp_path / "hf", hf=True, max_shard_bytes=30_000)
    assert (out / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(module.model))


def test_hf_from_a_full_file_with_tied_embeddings(tmp_path):
    module = LitLlama(tie=True).eval()
    sd = module.state_dict()
    assert sd["model.lm_head.weight"].data_ptr() == sd["model.model.embed_tokens.weight"].data_ptr()
    torch.save({"state_dict": sd, "zeropp": {"hf": [hf_entry(module)]}}, tmp_path / "tied.ckpt")
    # shared storage survives torch.save; safetensors would refuse it, so the export copies
    out = consolidate(tmp_path / "tied.ckpt", tmp_path / "hf", hf=True)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(logits(model), logits(module.model))


def test_hf_several_models_get_a_folder_each(tmp_path):
    # e.g. PPO: actor and critic in one LightningModule
    torch.manual_seed(0)
    actor, critic = LlamaForCausalLM(llama_config()).eval(), LlamaForCausalLM(llama_config(tie=True)).eval()
    state = {**{"actor." + k: v for k, v in actor.state_dict().items()},
             **{"critic." + k: v for k, v in critic.state_dict().items()}}  # fmt: skip
    entries = [
        {"prefix": "actor.", "architecture": "LlamaForCausalLM", "config": actor.config.to_dict()},
        {"prefix": "critic.", "architecture": "LlamaForCausalLM", "config": critic.config.to_dict()},
    ]
    torch.save({"state_dict": state, "zeropp": {"hf": entries}}, tmp_path / "ppo.ckpt")
    out = consolidate(tmp_path / "ppo.ckpt", tmp_path / "hf", hf=True)
    assert sorted(p.name for p in out.iterdir()) == ["actor", "critic"]
    for name, model in (("actor", actor), ("critic", critic)):
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out / name)), logits(model))


def test_hf_writes_fused_moe_experts_in_their_saved_layout(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    if not hasattr(__import__("transformers.core_model_loading").core_model_loading, "revert_weight_conversion"):
        pytest.skip("transformers < 5 keeps experts unfused")
    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=3)  # fmt: skip
    model = MixtralForCausalLM(cfg).eval()
    entry = {"prefix": "lm.", "architecture": "MixtralForCausalLM", "config": model.config.to_dict()}
    state = {"lm." + k: v for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "zeropp": {"hf": [entry]}}, tmp_path / "moe.ckpt")
    for shard_bytes in (2**30, 40_000):
        out = consolidate(tmp_path / "moe.ckpt", tmp_path / f"hf-{shard_bytes}", hf=True, max_shard_bytes=shard_bytes)
        keys = set()
        for file in out.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                keys |= set(f.keys())
        assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in keys  # the on-disk (hub) names
        assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))


# -- (d) errors -------------------------------------------------------------------------------


def test_error_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope does not exist\. Fix"):
        consolidate(tmp_path / "nope", tmp_path / "out.ckpt")
    (tmp_path / "nope.old-1a2b").mkdir()  # a save over it stopped between its two renames
    with pytest.raises(FileNotFoundError, match=r"interrupted: the previous checkpoint is .*nope\.old-1a2b"):
        consolidate(tmp_path / "nope", tmp_path / "out.ckpt")


def test_error_incomplete_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=r"not a complete zeropp sharded checkpoint.*no zeropp_meta\.pt.*tmp-"):
        consolidate(tmp_path / "ckpt", tmp_path / "out.ckpt")
    (tmp_path / "ckpt.tmp-123").mkdir()  # what an interrupted save leaves
    with pytest.raises(ValueError, match=r"found: ckpt\.tmp-123"):
        consolidate(tmp_path / "ckpt", tmp_path / "out.ckpt")


def test_error_another_tools_dcp_checkpoint(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "fsdp", no_dist=True)
    with pytest.raises(ValueError, match=r"another tool's DCP checkpoint"):
        consolidate(tmp_path / "fsdp", tmp_path / "out.ckpt")


def test_error_out_exists_unless_overwrite(trained, tmp_path):
    _, _, ref, sharded = trained
    (tmp_path / "out.ckpt").write_text("old")
    with pytest.raises(FileExistsError, match=r"out\.ckpt already exists.*--overwrite"):
        consolidate(sharded, tmp_path / "out.ckpt")
    consolidate(sharded, tmp_path / "out.ckpt", overwrite=True)
    assert_same(torch.load(tmp_path / "out.ckpt", weights_only=True)["state_dict"], ref["state_dict"])
    # an old HF folder is replaced whole: no stale single-file weights beside new shards
    consolidate(sharded, tmp_path / "hf", hf=True)
    consolidate(sharded, tmp_path / "hf", hf=True, overwrite=True, max_shard_bytes=20_000)
    assert not (tmp_path / "hf" / "model.safetensors").exists()
    with pytest.raises(ValueError, match=r"is the checkpoint .* or contains it"):
        consolidate(sharded, sharded.parent, hf=True, overwrite=True)
    assert (sharded / META).is_file()


def test_error_no_hf_model(trained, tmp_path):
    _, _, _, sharded = trained
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    meta = torch.load(ckpt / META, weights_only=True)
    meta["zeropp"]["hf"] = []
    torch.save(meta, ckpt / META)
    with pytest.raises(ValueError, match=r"ckpt has no Hugging Face model.*held no transformers PreTrainedModel"):
        consolidate(ckpt, tmp_path / "hf", hf=True)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob("hf.tmp-*"))

    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "plain.ckpt")  # no zeropp metadata
    with pytest.raises(ValueError, match=r"without zeropp metadata"):
        consolidate(tmp_path / "plain.ckpt", tmp_path / "hf", hf=True)
    with pytest.raises(ValueError, match=r"already a full .*checkpoint"):
        consolidate(tmp_path / "plain.ckpt", tmp_path / "out.ckpt")


def test_error_weights_do_not_match_the_architecture(tmp_path):
    module = LitLlama()
    sd = module.state_dict()
    sd["model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(4, 32)
    torch.save({"state_dict": sd, "zeropp": {"hf": [hf_entry(module)]}}, tmp_path / "lora.ckpt")
    with pytest.raises(ValueError, match=r"do not match LlamaForCausalLM.*unexpected.*lora_A.*merge_and_unload"):
        consolidate(tmp_path / "lora.ckpt", tmp_path / "hf", hf=True)


class Opaque:
    """Not allowed by torch.load(weights_only=True)."""


def test_error_unsafe_metadata_needs_explicit_opt_in(trained, tmp_path):
    _, _, _, sharded = trained
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    meta = torch.load(ckpt / META, weights_only=True)
    meta["hyper_parameters"]["extra"] = Opaque()
    torch.save(meta, ckpt / META)
    with pytest.raises(ValueError, match=r"zeropp_meta\.pt could not be loaded.*--unsafe-load.*weights_only=False"):
        consolidate(ckpt, tmp_path / "out.ckpt")
    out = consolidate(ckpt, tmp_path / "out.ckpt", weights_only=False)
    assert isinstance(torch.load(out, weights_only=False)["hyper_parameters"]["extra"], Opaque)


def test_error_newer_format_version_and_bad_arguments(trained, tmp_path):
    _, _, _, sharded = trained
    ckpt = shutil.copytree(sharded, tmp_path / "ckpt")
    meta = torch.load(ckpt / META, weights_only=True)
    meta["zeropp"]["version"] = 2
    torch.save(meta, ckpt / META)
    with pytest.raises(ValueError, match=r"format version 2.*reads versions up to 1"):
        consolidate(ckpt, tmp_path / "out.ckpt")
    with pytest.raises(ValueError, match=r"dtype='int8' is invalid"):
        consolidate(sharded, tmp_path / "out.ckpt", dtype="int8")
    with pytest.raises(ValueError, match=r"max_shard_bytes=0 is invalid"):
        consolidate(sharded, tmp_path / "hf", hf=True, max_shard_bytes=0)


# -- (e) command line ---------------------------------------------------------------------------


def test_cli(trained, tmp_path, capsys):
    module, _, ref, sharded = trained
    assert cli_main(["consolidate", str(sharded), str(tmp_path / "full.ckpt")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert_same(torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"], ref["state_dict"])

    argv = ["consolidate", str(sharded), str(tmp_path / "hf"), "--hf", "--dtype", "fp16", "--max-shard-size", "20KB"]
    assert cli_main(argv) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.float16 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()

    assert cli_main(argv) == 2  # OUT exists
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: ")  # after from_pretrained's progress bar
    assert cli_main([*argv, "--overwrite"]) == 0

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["consolidate", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("CKPT", "OUT", "--hf", "--dtype", "--max-shard-size", "--unsafe-load", "--overwrite"):
        assert flag in help_text


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size("4096") == 4096
    for bad in ("", "GB", "2XB", "0MB", "-1GB"):
        with pytest.raises(ValueError, match="invalid"):
            parse_size(bad)

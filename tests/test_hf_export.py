"""checkpoint/hf.py, the one Hugging Face exporter (``write_hf``).

    python -m pytest tests/test_hf_export.py -q

Single process, tiny Llama models built from a local LlamaConfig (nothing downloaded).
The reference is the source model itself: what ``from_pretrained`` loads back must equal
it bit for bit. Refusals are checked to leave nothing behind: no folder, no ``.tmp-``
sibling, an existing folder untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from zeropp_strategy.checkpoint.hf import HFModel, WeightReader, write_hf
from zeropp_strategy.checkpoint.integrity import CheckpointError

VOCAB = 53


def tiny(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def hf_model(model: LlamaForCausalLM, **kw) -> HFModel:
    return HFModel(weights=model.state_dict(), config=model.config, model_cls=type(model), **kw)


def assert_equal_models(loaded: torch.nn.Module, source: torch.nn.Module) -> None:
    a, b = loaded.state_dict(), source.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, source(input_ids=ids).logits)


def nothing_left(folder: Path) -> bool:
    return not folder.exists() and not list(folder.parent.glob(f"{folder.name}.tmp-*"))


def test_folder_loads_back_equal_to_the_source(tmp_path):
    model = tiny()
    generation = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=2)
    out = write_hf(tmp_path / "lm", hf_model(model, generation_config=generation))
    assert out == tmp_path / "lm" and nothing_left(tmp_path / "lm.tmp-x")
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "generation_config.json"}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 5
    assert_equal_models(AutoModelForCausalLM.from_pretrained(out).eval(), model)


def test_tied_weights_sharding_and_dtype(tmp_path):
    tied = tiny(tie=True)
    out = write_hf(tmp_path / "tied", hf_model(tied), max_shard_bytes=10_000)
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    assert "lm_head.weight" not in index["weight_map"]  # written once, as save_pretrained does
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert_equal_models(loaded, tied)

    model = tiny()
    out = write_hf(tmp_path / "bf16", hf_model(model), dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k


def test_weight_reader_extra_files_tokenizer_and_several_models(tmp_path):
    actor, critic = tiny(seed=1), tiny(seed=2)
    state = critic.state_dict()
    reads = []
    reader = WeightReader({k: (v.shape, v.dtype) for k, v in state.items()},
                          lambda k: reads.append(k) or state[k].clone())
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    (tokenizer / "config.json").write_text('{"not": "ours"}')  # the model's config.json wins
    head = {"weight": torch.randn(1, 32)}
    models = {
        "actor": hf_model(actor),
        "critic": HFModel(weights=reader, config=critic.config, model_cls=LlamaForCausalLM, tokenizer=tokenizer,
                          extra_tensors={"value_head.safetensors": head}, extra_json={"stats.json": {"mean": 0.5}}),
    }
    out = write_hf(tmp_path / "ppo", models)
    assert sorted(p.name for p in out.iterdir()) == ["actor", "critic"]
    assert sorted(reads) == sorted(state)  # every weight read once, through the reader
    assert (out / "critic" / "tokenizer_config.json").is_file()
    assert json.loads((out / "critic" / "stats.json").read_text()) == {"mean": 0.5}
    with safe_open(str(out / "critic" / "value_head.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("weight"), head["weight"])
    assert_equal_models(AutoModelForCausalLM.from_pretrained(out / "critic").eval(), critic)
    assert_equal_models(AutoModelForCausalLM.from_pretrained(out / "actor").eval(), actor)


def test_partial_or_foreign_weights_are_refused_and_nothing_is_left(tmp_path):
    model = tiny()
    partial = dict(model.state_dict())
    del partial["model.layers.1.mlp.up_proj.weight"]
    folder = tmp_path / "lm"
    with pytest.raises(ValueError, match=r"cannot write .*lm: the weights from the state dict do not match "
                                         r"LlamaForCausalLM: missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        write_hf(folder, HFModel(weights=partial, config=model.config, model_cls=LlamaForCausalLM))
    assert nothing_left(folder)

    lora = {**model.state_dict(), "model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 32)}
    with pytest.raises(ValueError, match=r"unexpected \[.*lora_A.*merge_and_unload"):
        write_hf(folder, HFModel(weights=lora, config=model.config, model_cls=LlamaForCausalLM))
    with pytest.raises(ValueError, match=r"holds no weights of LlamaConfig, so the folder would be empty"):
        write_hf(folder, HFModel(weights={}, config=model.config))  # no class: unchecked, but not empty
    with pytest.raises(ValueError, match=r"weights \['w'\] are not tensors"):
        write_hf(folder, HFModel(weights={"w": 1.0}, config=model.config))

    class ComputesOnItsWeights(LlamaForCausalLM):  # an __init__ that reads a value: no meta build, no check
        def __init__(self, config):
            super().__init__(config)
            self.scale = float(self.model.embed_tokens.weight.detach().abs().max())

    with pytest.raises(ValueError, match=r"cannot check the weights against ComputesOnItsWeights: .* "
                                         r"Fix: pass HFModel\(model_cls=None\)"):
        write_hf(folder, HFModel(weights=model.state_dict(), config=model.config, model_cls=ComputesOnItsWeights))
    assert nothing_left(folder)


def test_a_failure_while_writing_leaves_nothing_and_keeps_the_old_folder(tmp_path, monkeypatch):
    model = tiny()
    folder = write_hf(tmp_path / "lm", hf_model(model))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    state = model.state_dict()

    def failing(name: str) -> torch.Tensor:
        if name.startswith("model.layers.1."):
            raise OSError("No space left on device")
        return state[name]

    reader = WeightReader({k: (v.shape, v.dtype) for k, v in state.items()}, failing)
    with pytest.raises(OSError, match="No space left"):
        write_hf(folder, HFModel(weights=reader, config=model.config, model_cls=LlamaForCausalLM),
                 overwrite=True, max_shard_bytes=10_000)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not list(tmp_path.glob("lm.tmp-*"))

    # What was written is read back: a writer that silently drops a tensor is caught.
    import safetensors.torch

    real = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file",
                        lambda tensors, path, metadata=None: real(dict(list(tensors.items())[1:]), path, metadata))
    with pytest.raises(CheckpointError, match=r"lm: reading back what was written, 1 of \d+ tensors"):
        write_hf(folder, hf_model(model), overwrite=True)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not list(tmp_path.glob("lm.tmp-*"))


def test_an_existing_folder_is_refused_unless_overwrite_then_replaced_whole(tmp_path):
    old, new = tiny(seed=1), tiny(seed=2)
    folder = write_hf(tmp_path / "lm", hf_model(old))
    (folder / "stale.txt").write_text("from an earlier export")
    with pytest.raises(FileExistsError, match=r"lm already exists\. Fix: .*overwrite=True"):
        write_hf(folder, hf_model(new))
    assert_equal_models(AutoModelForCausalLM.from_pretrained(folder).eval(), old)
    write_hf(folder, hf_model(new), overwrite=True, max_shard_bytes=10_000)
    assert not (folder / "stale.txt").exists() and not (folder / "model.safetensors").exists()
    assert_equal_models(AutoModelForCausalLM.from_pretrained(folder).eval(), new)
    assert not list(tmp_path.glob("lm.*"))  # no .tmp- or .old- sibling


def test_bad_arguments_name_the_parameter(tmp_path):
    model = tiny()
    cases = [
        (dict(max_shard_bytes=0), r"max_shard_bytes=0 is invalid"),
        (dict(dtype=torch.int8), r"dtype=torch\.int8 is invalid"),
        (dict(models={}), r"models is invalid: it is empty"),
        (dict(models={"a/b": hf_model(model)}), r"models is invalid: the entries \['a/b'\].*plain subfolder names"),
        (dict(models=hf_model(model, extra_json={"config.json": {}})), r"extra file name 'config\.json' is invalid"),
        (dict(models=hf_model(model, extra_tensors={"head.bin": {"w": torch.ones(1)}})),
         r"extra file name 'head\.bin' is invalid"),
        (dict(models=hf_model(model, tokenizer=tmp_path / "nope")), r"tokenizer=.*nope' is not a folder"),
    ]
    for kwargs, pattern in cases:
        models = kwargs.pop("models", hf_model(model))
        with pytest.raises(ValueError, match=pattern):
            write_hf(tmp_path / "lm", models, **kwargs)
    assert nothing_left(tmp_path / "lm")

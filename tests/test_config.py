"""ZeroConfig: validation messages, serialisation, YAML / JSON files and the DeepSpeed import.

    python -m pytest tests/test_config.py -q

Single process, no torch: every check here is about what a user types.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeropp_strategy.config import OffloadConfig, ZeroConfig, ZeroConfigWarning


class LlamaDecoderLayer:  # stands in for a transformer block class
    pass


# -- construction and per-field validation ---------------------------------------------------


def test_defaults_construct():
    cfg = ZeroConfig()
    assert cfg.stage == 3 and not cfg.quantized_weights and cfg.hpz_partition_size == 1
    assert cfg.offload_optimizer == OffloadConfig() and cfg.offload_param.device == "none"
    assert cfg.wrap_modules == () and cfg.state_dict_type is None and cfg.simulated_nodes == 0
    assert cfg.reduce_bucket_bytes == 25 * 2**20 and cfg.allgather_bucket_bytes == 50 * 2**20
    assert cfg.resolved_state_dict_type() == "sharded"
    assert ZeroConfig(stage=1).resolved_state_dict_type() == "full"
    assert ZeroConfig(stage=1, state_dict_type="sharded").resolved_state_dict_type() == "sharded"
    hash(cfg)  # frozen and hashable: usable as a cache key


def test_frozen_and_keyword_only():
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZeroConfig(3)  # type: ignore[misc]


def test_full_zeropp_config_constructs():
    cfg = ZeroConfig(stage=3, quantized_weights=True, hpz_partition_size=8, quantized_gradients=True,
                     gradient_quant_bits=8, weight_quant_block_elems=32, gradient_quant_block_elems=65536,
                     quantize_frozen_weights=True, offload_param="cpu",
                     offload_optimizer={"device": "nvme", "nvme_path": Path("/nvme"), "buffer_count": 2},
                     wrap_modules=[LlamaDecoderLayer, "GPT2Block", "LlamaDecoderLayer"], state_dict_type="full")
    assert cfg.offload_param == OffloadConfig(device="cpu")
    assert cfg.offload_optimizer.nvme_path == "/nvme" and isinstance(cfg.offload_optimizer.nvme_path, str)
    assert cfg.wrap_modules == ("LlamaDecoderLayer", "GPT2Block")  # classes -> names, duplicates dropped
    assert ZeroConfig(wrap_modules="GPT2Block").wrap_modules == ("GPT2Block",)


@pytest.mark.parametrize("kwargs", [
    dict(stage=2, quantized_gradients=True),
    dict(stage=1, offload_optimizer="cpu"),
    dict(stage=2, offload_optimizer={"device": "cpu", "pin_memory": False}),
    dict(stage=1, quantize_min_elems=0, wrap_min_params=1, reduce_bucket_bytes=1024, allgather_bucket_bytes=1024),
    dict(stage=3, hpz_partition_size=1, simulated_nodes=2),
])
def test_valid_combinations(kwargs):
    ZeroConfig(**kwargs)


BAD = [  # (kwargs, exception, substring that names the field)
    (dict(stage=4), ValueError, "ZeroConfig.stage=4"),
    (dict(stage=0), ValueError, "ZeroConfig.stage=0"),
    (dict(stage=True), TypeError, "ZeroConfig.stage=True"),
    (dict(stage="3"), TypeError, "ZeroConfig.stage='3'"),
    (dict(stage=3.0), TypeError, "ZeroConfig.stage=3.0"),
    (dict(quantized_weights=1), TypeError, "ZeroConfig.quantized_weights=1"),
    (dict(stage=2, quantized_weights=True), ValueError, "ZeroConfig.quantized_weights=True"),
    (dict(weight_quant_block_elems=100), ValueError, "ZeroConfig.weight_quant_block_elems=100"),
    (dict(weight_quant_block_elems=16), ValueError, "ZeroConfig.weight_quant_block_elems=16"),
    (dict(weight_quant_block_elems=131072), ValueError, "ZeroConfig.weight_quant_block_elems"),
    (dict(weight_quant_block_elems=True), TypeError, "ZeroConfig.weight_quant_block_elems"),
    (dict(weight_quant_block_elems=256.0), TypeError, "ZeroConfig.weight_quant_block_elems"),
    (dict(hpz_partition_size=-1), ValueError, "ZeroConfig.hpz_partition_size=-1"),
    (dict(hpz_partition_size=True), TypeError, "ZeroConfig.hpz_partition_size"),
    (dict(stage=2, hpz_partition_size=8), ValueError, "ZeroConfig.hpz_partition_size=8"),
    (dict(quantized_gradients="yes"), TypeError, "ZeroConfig.quantized_gradients"),
    (dict(stage=1, quantized_gradients=True), ValueError, "ZeroConfig.quantized_gradients=True"),
    (dict(gradient_quant_bits=2), ValueError, "ZeroConfig.gradient_quant_bits=2"),
    (dict(gradient_quant_bits=16), ValueError, "ZeroConfig.gradient_quant_bits=16"),
    (dict(gradient_quant_bits=True), TypeError, "ZeroConfig.gradient_quant_bits"),
    (dict(gradient_quant_block_elems=300), ValueError, "ZeroConfig.gradient_quant_block_elems=300"),
    (dict(gradient_quant_block_elems=0), ValueError, "ZeroConfig.gradient_quant_block_elems=0"),
    (dict(quantized_gradients_on_single_node=None), TypeError, "ZeroConfig.quantized_gradients_on_single_node"),
    (dict(quantize_min_elems=-1), ValueError, "ZeroConfig.quantize_min_elems=-1"),
    (dict(quantize_min_elems=1.5), TypeError, "ZeroConfig.quantize_min_elems"),
    (dict(quantize_frozen_weights=0), TypeError, "ZeroConfig.quantize_frozen_weights"),
    (dict(stage=2, quantize_frozen_weights=True), ValueError, "ZeroConfig.quantize_frozen_weights=True"),
    (dict(offload_optimizer="gpu"), ValueError, "ZeroConfig.offload_optimizer.device='gpu'"),
    (dict(offload_optimizer="CPU"), ValueError, "ZeroConfig.offload_optimizer.device"),
    (dict(offload_optimizer={"device": "nvme"}), ValueError, "ZeroConfig.offload_optimizer.nvme_path=None"),
    (dict(offload_optimizer={"device": "nvme", "nvme_path": ""}), ValueError, "ZeroConfig.offload_optimizer.nvme_path"),
    (dict(offload_optimizer={"buffer_count": 1}), ValueError, "ZeroConfig.offload_optimizer.buffer_count=1"),
    (dict(offload_optimizer={"buffer_count": 4.0}), TypeError, "ZeroConfig.offload_optimizer.buffer_count"),
    (dict(offload_optimizer={"buffer_bytes": 100}), ValueError, "ZeroConfig.offload_optimizer.buffer_bytes=100"),
    (dict(offload_optimizer={"pin_memory": "yes"}), TypeError, "ZeroConfig.offload_optimizer.pin_memory"),
    (dict(offload_optimizer={"buffer_size": 1}), ValueError, "ZeroConfig.offload_optimizer.buffer_size"),
    (dict(offload_optimizer=5), TypeError, "ZeroConfig.offload_optimizer=5"),
    (dict(offload_optimizer=None), TypeError, "ZeroConfig.offload_optimizer=None"),
    (dict(offload_param={"device": 3}), TypeError, "ZeroConfig.offload_param.device=3"),
    (dict(offload_param={"device": "nvme", "nvme_path": 5}), TypeError, "ZeroConfig.offload_param.nvme_path=5"),
    (dict(stage=2, offload_param="cpu"), ValueError, "ZeroConfig.offload_param.device='cpu'"),
    (dict(stage=1, offload_param={"device": "nvme", "nvme_path": "/x"}), ValueError, "ZeroConfig.offload_param"),
    (dict(wrap_modules="transformers.LlamaDecoderLayer"), ValueError, "ZeroConfig.wrap_modules"),
    (dict(wrap_modules=[""]), ValueError, "ZeroConfig.wrap_modules"),
    (dict(wrap_modules=[1]), TypeError, "ZeroConfig.wrap_modules"),
    (dict(wrap_modules={"GPT2Block"}), TypeError, "ZeroConfig.wrap_modules"),
    (dict(wrap_modules=None), TypeError, "ZeroConfig.wrap_modules=None"),
    (dict(wrap_min_params=0), ValueError, "ZeroConfig.wrap_min_params=0"),
    (dict(activation_checkpointing="true"), TypeError, "ZeroConfig.activation_checkpointing"),
    (dict(reduce_bucket_bytes=1023), ValueError, "ZeroConfig.reduce_bucket_bytes=1023"),
    (dict(reduce_bucket_bytes=5e8), TypeError, "ZeroConfig.reduce_bucket_bytes=500000000.0"),
    (dict(allgather_bucket_bytes=0), ValueError, "ZeroConfig.allgather_bucket_bytes=0"),
    (dict(state_dict_type="full_state_dict"), ValueError, "ZeroConfig.state_dict_type='full_state_dict'"),
    (dict(state_dict_type=1), TypeError, "ZeroConfig.state_dict_type=1"),
    (dict(simulated_nodes=-1), ValueError, "ZeroConfig.simulated_nodes=-1"),
    (dict(simulated_nodes=True), TypeError, "ZeroConfig.simulated_nodes=True"),
    (dict(peer_timeout=-1), ValueError, "ZeroConfig.peer_timeout=-1"),
    (dict(peer_timeout=float("inf")), ValueError, "ZeroConfig.peer_timeout=inf"),
    (dict(peer_timeout="60"), TypeError, "ZeroConfig.peer_timeout='60'"),
    (dict(cross_node_scale_bits=8), ValueError, "ZeroConfig.cross_node_scale_bits=8 is invalid: must be 32 or 16"),
    (dict(cross_node_scale_bits="16"), TypeError, "ZeroConfig.cross_node_scale_bits='16'"),
]


@pytest.mark.parametrize("kwargs,exc,substring", BAD, ids=[str(k) for k, _, _ in BAD])
def test_bad_values_name_field_value_and_fix(kwargs, exc, substring):
    with pytest.raises(exc) as info:
        ZeroConfig(**kwargs)
    assert type(info.value) is exc
    msg = str(info.value)
    assert substring in msg and " is invalid: " in msg and ". Fix: " in msg, msg


def test_stage_message_matches_the_documented_form():
    with pytest.raises(ValueError) as info:
        ZeroConfig(stage=4)
    assert str(info.value) == ("ZeroConfig.stage=4 is invalid: must be 1, 2 or 3. "
                               "Fix: use stage=3 for full sharding, or strategy='ddp' for none.")


def test_offload_config_standalone():
    assert OffloadConfig(device="nvme", nvme_path="/nvme").nvme_path == "/nvme"
    assert OffloadConfig(device="cpu", nvme_path="/ignored").device == "cpu"  # allowed, unused
    with pytest.raises(ValueError, match=r"OffloadConfig\.device='disk' is invalid: .* Fix: "):
        OffloadConfig(device="disk")
    with pytest.raises(TypeError, match=r"OffloadConfig\.buffer_count=True"):
        OffloadConfig(buffer_count=True)


# -- dicts, replace, digest -------------------------------------------------------------------


def _rich() -> ZeroConfig:
    return ZeroConfig(stage=3, quantized_weights=True, hpz_partition_size=4, quantized_gradients=True,
                      offload_optimizer={"device": "nvme", "nvme_path": "/nvme", "buffer_bytes": 8192},
                      offload_param="cpu", wrap_modules=[LlamaDecoderLayer], state_dict_type="full",
                      simulated_nodes=2, activation_checkpointing=True)


def test_to_dict_from_dict_round_trip():
    for cfg in (ZeroConfig(), _rich(), ZeroConfig(stage=1, reduce_bucket_bytes=4096)):
        d = cfg.to_dict()
        assert d["offload_optimizer"] == dataclasses.asdict(cfg.offload_optimizer)
        assert isinstance(d["wrap_modules"], list)
        assert ZeroConfig.from_dict(d) == cfg
        assert ZeroConfig.from_dict(json.loads(json.dumps(d))) == cfg  # JSON-able


@pytest.mark.parametrize("key,suggestion", [("stag", "stage"), ("quantised_weights", "quantized_weights"),
                                            ("hpz_partition", "hpz_partition_size"),
                                            ("reduce_bucket_size", "reduce_bucket_bytes")])
def test_unknown_key_suggests_closest(key, suggestion):
    with pytest.raises(ValueError) as info:
        ZeroConfig.from_dict({key: 3})
    msg = str(info.value)
    assert f"ZeroConfig.{key}=3 is invalid" in msg and f"did you mean {suggestion!r}?" in msg
    with pytest.raises(ValueError, match=f"did you mean {suggestion!r}"):
        ZeroConfig().replace(**{key: 3})


def test_from_dict_rejects_non_mappings_and_points_deepspeed_users_at_from_deepspeed():
    with pytest.raises(TypeError, match=r"ZeroConfig\.from_dict"):
        ZeroConfig.from_dict([("stage", 3)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ZeroConfig\[1\]"):
        ZeroConfig.from_dict({1: 3})
    with pytest.raises(ValueError, match=r"ZeroConfig\.zero_optimization=.*from_deepspeed"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_param\.buffer_size=.*did you mean"):
        ZeroConfig.from_dict({"offload_param": {"device": "cpu", "buffer_size": 10}})


def test_replace_revalidates():
    cfg = ZeroConfig(quantized_weights=True)
    assert cfg.replace(hpz_partition_size=2).hpz_partition_size == 2
    assert cfg.replace(quantized_weights=False, stage=1).stage == 1
    with pytest.raises(ValueError, match=r"ZeroConfig\.quantized_weights=True"):
        cfg.replace(stage=2)
    assert cfg.quantized_weights and cfg.stage == 3  # original untouched


def test_digest_stable_and_sensitive():
    a = _rich()
    b = ZeroConfig.from_dict(json.loads(json.dumps(a.to_dict())))
    assert a.digest() == b.digest() and len(a.digest()) == 64
    canon = json.dumps(a.to_dict(), sort_keys=True, separators=(",", ":")).encode()
    assert a.digest() == hashlib.sha256(canon).hexdigest()
    assert ZeroConfig(wrap_modules=("X",)).digest() == ZeroConfig(wrap_modules=["X"]).digest()
    assert ZeroConfig(offload_param="cpu").digest() == ZeroConfig(offload_param=OffloadConfig(device="cpu")).digest()
    digests = {a.digest(), a.replace(simulated_nodes=0).digest(), a.replace(gradient_quant_bits=8).digest(),
               a.replace(offload_optimizer={"device": "cpu"}).digest(), ZeroConfig().digest()}
    assert len(digests) == 5


# -- validate_for_world ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,world,per_node", [
    (dict(), 1, 1), (dict(hpz_partition_size=4), 8, 4), (dict(hpz_partition_size=8), 8, 8),
    (dict(simulated_nodes=2), 4, 4), (dict(simulated_nodes=4, hpz_partition_size=2), 4, 4),
])
def test_validate_for_world_ok(kwargs, world, per_node):
    ZeroConfig(**kwargs).validate_for_world(world, per_node)


@pytest.mark.parametrize("kwargs,world,per_node,exc,substring", [
    (dict(hpz_partition_size=3), 8, 4, ValueError, "ZeroConfig.hpz_partition_size=3"),
    (dict(hpz_partition_size=16), 8, 8, ValueError, "ZeroConfig.hpz_partition_size=16"),
    (dict(simulated_nodes=3), 4, 4, ValueError, "ZeroConfig.simulated_nodes=3"),
    (dict(simulated_nodes=8), 4, 4, ValueError, "ZeroConfig.simulated_nodes=8"),
    (dict(), 0, 1, ValueError, "world_size"),
    (dict(), 4, 8, ValueError, "ranks_per_node"),
    (dict(), True, 1, TypeError, "world_size"),
    (dict(), 4, 2.0, TypeError, "ranks_per_node"),
])
def test_validate_for_world_errors(kwargs, world, per_node, exc, substring):
    with pytest.raises(exc) as info:
        ZeroConfig(**kwargs).validate_for_world(world, per_node)
    assert substring in str(info.value) and "Fix: " in str(info.value)


# -- YAML / JSON files -------------------------------------------------------------------------


def test_from_yaml_top_level_and_under_zero(tmp_path):
    top = tmp_path / "top.yaml"
    top.write_text("stage: 2\nquantized_gradients: true\noffload_optimizer: cpu\nwrap_modules: [GPT2Block]\n")
    cfg = ZeroConfig.from_yaml(top)
    assert cfg == ZeroConfig(stage=2, quantized_gradients=True, offload_optimizer="cpu", wrap_modules=("GPT2Block",))
    nested = tmp_path / "recipe.yml"
    nested.write_text("trainer:\n  max_steps: 10\nzero:\n  stage: 2\n  quantized_gradients: true\n"
                      "  offload_optimizer: {device: cpu}\n  wrap_modules: GPT2Block\n")
    assert ZeroConfig.from_yaml(str(nested)) == cfg
    assert ZeroConfig.from_file(nested) == cfg
    (tmp_path / "defaults.yaml").write_text("zero:\n")
    assert ZeroConfig.from_yaml(tmp_path / "defaults.yaml") == ZeroConfig()


def test_from_yaml_errors_name_the_path(tmp_path):
    empty, seq, bad, typo = (tmp_path / n for n in ("empty.yaml", "seq.yaml", "bad.yaml", "typo.yaml"))
    empty.write_text("")
    seq.write_text("- stage\n- 3\n")
    bad.write_text("stage: [3\n")
    typo.write_text("zero:\n  stag: 2\n")
    with pytest.raises(ValueError, match="empty") as info:
        ZeroConfig.from_yaml(empty)
    assert str(empty) in str(info.value)
    with pytest.raises(ValueError, match="list, not a mapping") as info:
        ZeroConfig.from_yaml(seq)
    assert str(seq) in str(info.value)
    with pytest.raises(ValueError, match="not valid YAML") as info:
        ZeroConfig.from_yaml(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(ValueError, match="did you mean 'stage'") as info:
        ZeroConfig.from_yaml(typo)
    assert str(typo) in str(info.value)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        ZeroConfig.from_yaml(tmp_path / "missing.yaml")


def test_from_file_dispatch(tmp_path):
    ours = tmp_path / "zero.json"
    ours.write_text(json.dumps(_rich().to_dict()))
    assert ZeroConfig.from_file(ours) == _rich()
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2}}))
    with pytest.warns(ZeroConfigWarning, match="train_batch_size"):
        assert ZeroConfig.from_file(ds) == ZeroConfig(stage=2)
    with pytest.raises(ValueError, match=r"\.toml"):
        ZeroConfig.from_file(tmp_path / "zero.toml")


# -- DeepSpeed import --------------------------------------------------------------------------

# Shaped like the ZeRO++ example in DeepSpeed's docs (tutorials/zeropp), plus common extras.
ZEROPP_DS = {
    "train_batch_size": 64,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": 5e8,
        "reduce_scatter": True,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 8,
        "zero_quantized_gradients": True,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "stage3_max_live_parameters": 1e9,
    },
}


def _one_warning(record) -> str:
    mine = [w for w in record if issubclass(w.category, ZeroConfigWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    return str(mine[0].message)


def test_from_deepspeed_zeropp_dict():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = ZeroConfig.from_deepspeed(ZEROPP_DS)
    assert cfg.stage == 3 and cfg.quantized_weights and cfg.quantized_gradients
    assert cfg.hpz_partition_size == 8
    assert cfg.reduce_bucket_bytes == 500_000_000 * 2  # 5e8 bf16 elements
    assert cfg.allgather_bucket_bytes == ZeroConfig().allgather_bucket_bytes  # not given: default
    msg = _one_warning(record)
    for key in ("train_batch_size", "gradient_clipping", "bf16", "zero_optimization.reduce_scatter",
                "zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
                "zero_optimization.stage3_max_live_parameters"):
        assert key in msg, key
    assert "7 DeepSpeed setting(s)" in msg
    assert "Trainer(gradient_clip_val=...)" in msg and "Trainer(precision=" in msg
    for mapped in ("zero_quantized_weights", "zero_hpz_partition_size", "reduce_bucket_size", ".stage\n"):
        assert mapped not in msg


@pytest.mark.parametrize("precision,elem_bytes", [
    ({}, 4), ({"bf16": {"enabled": True}}, 2), ({"fp16": {"enabled": True}}, 2),
    ({"bf16": {"enabled": False}}, 4), ({"bf16": {"enabled": "auto"}}, 4),
])
def test_from_deepspeed_sizes_are_elements(precision, elem_bytes):
    ds = {**precision, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1000,
                                             "allgather_bucket_size": "2e3"}}
    cfg = ZeroConfig.from_deepspeed(ds, warn=False)
    assert cfg.reduce_bucket_bytes == 1000 * elem_bytes and cfg.allgather_bucket_bytes == 2000 * elem_bytes


def test_from_deepspeed_no_warning_when_nothing_ignored():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True,
                                                               "gather_16bit_weights_on_model_save": True}})
    assert cfg == ZeroConfig(stage=2, quantized_gradients=True, state_dict_type="full")


def test_from_deepspeed_file_on_disk(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZEROPP_DS))
    with pytest.warns(ZeroConfigWarning, match="gradient_clipping") as record:
        by_path = ZeroConfig.from_deepspeed(path)
    assert str(path) in _one_warning(record)
    assert ZeroConfig.from_deepspeed(str(path), warn=False) == by_path == ZeroConfig.from_deepspeed(ZEROPP_DS, warn=False)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        ZeroConfig.from_deepspeed(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ValueError, match="not valid JSON") as info:
        ZeroConfig.from_deepspeed(broken)
    assert str(broken) in str(info.value) and "line 1" in str(info.value)


def test_from_deepspeed_offload_nvme():
    ds = {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False, "ratio": 0.3},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
    }}
    with pytest.warns(ZeroConfigWarning) as record:
        cfg = ZeroConfig.from_deepspeed(ds)
    assert cfg.offload_optimizer == OffloadConfig(device="nvme", nvme_path="/local_nvme", buffer_count=4)
    assert cfg.offload_param == OffloadConfig(device="nvme", nvme_path="/local_nvme", pin_memory=False,
                                              buffer_count=5, buffer_bytes=2 * 10**8)
    msg = _one_warning(record)
    for key in ("zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_optimizer.ratio",
                "zero_optimization.offload_param.max_in_cpu", "bf16"):
        assert key in msg
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_param\.device='cpu'.*zero_optimization\.offload_param"
                                         r"\.device"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"ZeroConfig\.offload_optimizer\.nvme_path=None"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})


def test_from_deepspeed_auto_values():
    hf = {  # Accelerate / HF Trainer style: "auto" is filled in elsewhere
        "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "auto", "buffer_size": "auto"},
            "overlap_comm": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
            "zero_hpz_partition_size": "auto", "zero_quantized_weights": "auto",
            "stage3_prefetch_bucket_size": "auto", "stage3_gather_16bit_weights_on_model_save": True,
        },
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }
    with pytest.warns(ZeroConfigWarning) as record:
        cfg = ZeroConfig.from_deepspeed(hf)
    assert cfg == ZeroConfig(offload_optimizer="cpu", state_dict_type="full")
    msg = _one_warning(record)
    assert "Trainer(accumulate_grad_batches=...)" in msg and "DataLoader batch_size" in msg
    assert ZeroConfig.from_deepspeed({"zero_optimization": {"stage": "auto"}}, warn=False).stage == 3


@pytest.mark.parametrize("ds", [{"zero_optimization": {"stage": 0}}, {"zero_optimization": {}},
                                {"train_batch_size": 8}, {"zero_optimization": {"stage": "0"}}])
def test_from_deepspeed_stage_0_is_ddp(ds):
    with pytest.raises(ValueError, match=r"stage 0 is plain data parallel; use strategy='ddp'") as info:
        ZeroConfig.from_deepspeed(ds)
    assert "ZeroConfig.stage" in str(info.value) and "Fix: " in str(info.value)


@pytest.mark.parametrize("ds,exc,substrings", [
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1.5}}, ValueError,
     ["ZeroConfig.from_deepspeed", "zero_optimization.reduce_bucket_size=1.5", "Fix: "]),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}}, ValueError, ["reduce_bucket_size='big'"]),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": "yes"}}, TypeError,
     ["ZeroConfig.quantized_weights='yes'", "zero_optimization.zero_quantized_weights"]),
    ({"zero_optimization": {"stage": 4}}, ValueError, ["ZeroConfig.stage=4", "zero_optimization.stage"]),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, ValueError,
     ["ZeroConfig.hpz_partition_size=8", "zero_optimization.zero_hpz_partition_size"]),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x",
                                                          "buffer_count": True}}}, ValueError,
     ["zero_optimization.offload_param.buffer_count=True"]),
    ({"zero_optimization": [3]}, TypeError, ["zero_optimization=[3]"]),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}}, TypeError, ["offload_param='cpu'"]),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 1.5}}},
     ValueError, ["ZeroConfig.gradient_error_beta=1.5", "zero_optimization.zeropp_loco_param.err_beta", "Fix: "]),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {"reset_T": 10}}}, ValueError,
     ["ZeroConfig.gradient_error_feedback=True", "zero_quantized_gradients: true"]),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": 0.8}}, TypeError,
     ["zeropp_loco_param=0.8"]),
])
def test_from_deepspeed_bad_values(ds, exc, substrings):
    with pytest.raises(exc) as info:
        ZeroConfig.from_deepspeed(ds, warn=False)
    for s in substrings:
        assert s in str(info.value), str(info.value)


def test_from_deepspeed_rejects_other_types():
    with pytest.raises(TypeError, match=r"ZeroConfig\.from_deepspeed"):
        ZeroConfig.from_deepspeed(42)  # type: ignore[arg-type]


# -- property: any input either constructs or fails with our message, never anything else -----

_junk = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**17), st.floats(allow_nan=True),
                  st.text(max_size=6), st.lists(st.integers(), max_size=2))


def _mostly(values):
    """Usually a value from ``values`` (which mixes valid and invalid ones), sometimes junk."""
    return st.integers(0, 5).flatmap(lambda i: _junk if i == 0 else values)


_offload = _mostly(st.one_of(
    st.sampled_from(["none", "cpu", "nvme", "gpu"]),
    st.fixed_dictionaries({}, optional={
        "device": _mostly(st.sampled_from(["none", "cpu", "nvme"])),
        "nvme_path": _mostly(st.sampled_from(["/nvme", None])),
        "pin_memory": _mostly(st.booleans()),
        "buffer_count": _mostly(st.integers(1, 8)),
        "buffer_bytes": _mostly(st.integers(4000, 2**20)),
        "bogus": _junk,
    })))
_names = st.lists(st.sampled_from(["GPT2Block", "Block", LlamaDecoderLayer, "a.b", "", 3]), max_size=3)
_FIELD_VALUES = {
    "stage": _mostly(st.integers(0, 4)),
    "quantized_weights": _mostly(st.booleans()),
    "weight_quant_block_elems": _mostly(st.sampled_from([16, 32, 256, 65536, 131072, 100])),
    "weight_quant_bits": _mostly(st.sampled_from([2, 4, 8, 16])),
    "weight_delta_coding": _mostly(st.booleans()),
    "hpz_partition_size": _mostly(st.integers(0, 16)),
    "quantized_gradients": _mostly(st.booleans()),
    "gradient_quant_bits": _mostly(st.sampled_from([2, 4, 8, 16])),
    "gradient_quant_bits_intra": _mostly(st.sampled_from([None, 2, 4, 8])),
    "gradient_error_feedback": _mostly(st.booleans()),
    "gradient_error_feedback_intra": _mostly(st.booleans()),
    "gradient_error_beta": _mostly(st.one_of(st.floats(-1, 2), st.sampled_from([0, 0.8, 1, float("nan"), True]))),
    "gradient_error_reset_steps": _mostly(st.integers(-2, 4096)),
    "gradient_quant_block_elems": _mostly(st.sampled_from([32, 64, 300])),
    "cross_node_scale_bits": _mostly(st.sampled_from([16, 32, 8, 64])),
    "quantized_gradients_on_single_node": _mostly(st.booleans()),
    "quantize_min_elems": _mostly(st.integers(-2, 10**6)),
    "quantize_frozen_weights": _mostly(st.booleans()),
    "frozen_weight_bits": _mostly(st.sampled_from([2, 4, 8, 16])),
    "offload_optimizer": _offload,
    "offload_param": _offload,
    "host_memory_budget_bytes": _mostly(st.sampled_from(["auto", None, 2**30, 2**20 - 1, "12GB", 1.5])),
    "wrap_modules": _mostly(st.one_of(_names, _names.map(tuple), st.sampled_from(["GPT2Block", LlamaDecoderLayer]))),
    "wrap_min_params": _mostly(st.integers(0, 10**7)),
    "activation_checkpointing": _mostly(st.booleans()),
    "meta_init": _mostly(st.booleans()),
    "reduce_bucket_bytes": _mostly(st.integers(1000, 2**30)),
    "allgather_bucket_bytes": _mostly(st.integers(1000, 2**30)),
    "overlap_param_gather": _mostly(st.booleans()),
    "state_dict_type": _mostly(st.sampled_from([None, "sharded", "full", "FULL"])),
    "gather_16bit": _mostly(st.sampled_from([None, True, False])),
    "reduce_dtype": _mostly(st.sampled_from([None, "fp32", "bf16", "fp16", "BF16", "int8"])),
    "simulated_nodes": _mostly(st.integers(-1, 8)),
    "peer_timeout": _mostly(st.one_of(st.floats(-1, 100), st.integers(-1, 100))),
}
assert set(_FIELD_VALUES) == {f.name for f in dataclasses.fields(ZeroConfig)}


def _check(build):
    try:
        cfg = build()
    except (ValueError, TypeError) as e:
        assert "ZeroConfig." in str(e) and "Fix: " in str(e), str(e)
        return None
    assert ZeroConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    return cfg


@settings(max_examples=300, deadline=None, database=None)
@given(st.fixed_dictionaries({}, optional=_FIELD_VALUES))
def test_property_construct_or_clear_error(kwargs):
    _check(lambda: ZeroConfig(**kwargs))


@settings(max_examples=100, deadline=None, database=None)
@given(st.fixed_dictionaries({}, optional={**_FIELD_VALUES, "stag": _junk, "zero_optimization": _junk}))
def test_property_from_dict(d):
    _check(lambda: ZeroConfig.from_dict(d))


_ds_value = st.one_of(_junk, st.just("auto"), st.sampled_from([1e3, "5e8", 2e9, 8]))


@settings(max_examples=150, deadline=None, database=None)
@given(st.fixed_dictionaries({}, optional={
    "bf16": st.one_of(st.fixed_dictionaries({"enabled": st.one_of(st.booleans(), st.just("auto"))}), _junk),
    "gradient_clipping": _junk,
    "communication_data_type": st.one_of(_junk, st.sampled_from(["bf16", "fp16", "fp32", "bfloat16", "auto", "fp8"])),
    "zero_optimization": st.one_of(_junk, st.fixed_dictionaries({}, optional={
        "stage": st.one_of(st.integers(0, 4), _ds_value), "zero_quantized_weights": _ds_value,
        "zero_hpz_partition_size": st.one_of(st.integers(1, 8), _ds_value),
        "zero_quantized_gradients": _ds_value, "reduce_bucket_size": _ds_value,
        "allgather_bucket_size": _ds_value, "overlap_comm": _junk,
        "zeropp_loco_param": st.one_of(_junk, st.fixed_dictionaries({}, optional={
            "err_beta": st.one_of(_junk, st.floats(-1, 2)), "reset_T": _ds_value})),
        "offload_optimizer": st.one_of(_junk, st.fixed_dictionaries({}, optional={
            "device": st.one_of(st.sampled_from(["cpu", "nvme", "none"]), _ds_value),
            "nvme_path": _ds_value, "buffer_size": _ds_value, "buffer_count": _ds_value, "ratio": _junk})),
    })),
}))
def test_property_from_deepspeed(ds):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ZeroConfigWarning)
        _check(lambda: ZeroConfig.from_deepspeed(ds))


def test_reduce_dtype_and_deepspeed_communication_data_type():
    assert ZeroConfig().reduce_dtype is None
    assert ZeroConfig(reduce_dtype="bf16").reduce_dtype == "bf16"
    with pytest.raises(ValueError, match=r"ZeroConfig.reduce_dtype='int8' is invalid.*Fix: use reduce_dtype='fp32'"):
        ZeroConfig(reduce_dtype="int8")
    ds = {"zero_optimization": {"stage": 3}}
    for ds_name, want in (("bf16", "bf16"), ("bfloat16", "bf16"), ("FP16", "fp16"), ("fp32", "fp32"), ("auto", None)):
        assert ZeroConfig.from_deepspeed({**ds, "communication_data_type": ds_name}).reduce_dtype == want
    with pytest.raises(ValueError, match=r"communication_data_type='fp8' is invalid"):
        ZeroConfig.from_deepspeed({**ds, "communication_data_type": "fp8"})


def test_coerce_accepts_every_config_form(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("stage: 2\n")
    assert ZeroConfig.coerce(None) == ZeroConfig()
    assert ZeroConfig.coerce({"stage": 1}).stage == 1
    assert ZeroConfig.coerce(str(path)).stage == 2
    assert ZeroConfig.coerce(path, overrides={"stage": 3}).stage == 3
    cfg = ZeroConfig(stage=2)
    assert ZeroConfig.coerce(cfg) is cfg
    with pytest.raises(TypeError, match=r"Front\(config\)=42 is invalid.*Fix: pass a ZeroConfig"):
        ZeroConfig.coerce(42, where="Front(config)")


@pytest.mark.parametrize("value,exc", [(2, ValueError), (16, ValueError), (0, ValueError), (True, TypeError),
                                       ("4", TypeError), (4.0, TypeError)])
def test_frozen_weight_bits_is_4_or_8(value, exc):
    assert ZeroConfig().frozen_weight_bits == 8
    assert ZeroConfig(quantize_frozen_weights=True, frozen_weight_bits=4).frozen_weight_bits == 4
    with pytest.raises(exc, match=rf"ZeroConfig.frozen_weight_bits={value!r} is invalid.*Fix: use 8 .* or 4"):
        ZeroConfig(frozen_weight_bits=value)


@pytest.mark.parametrize("value,exc", [(2, ValueError), (16, ValueError), (True, TypeError), ("4", TypeError)])
def test_weight_quant_bits_is_4_or_8(value, exc):
    """issue 35: qwZ's codes, int8 (ZeRO++) or int4 (the zeropp_4bit preset); the plan and the
    run's one-line description carry the choice."""
    from zeropp_strategy import PRESETS
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    assert ZeroConfig().weight_quant_bits == 8
    four = ZeroConfig(**PRESETS["zeropp_4bit"])
    assert (four.weight_quant_bits, four.weight_quant_block_elems) == (4, 64)
    plan = resolve(four, Topology(world_size=4, rank=0, ranks_per_node=2))
    assert plan.weight_bits == 4 and "qwZ int4 gathers across nodes" in plan.describe()
    with pytest.raises(exc, match=rf"ZeroConfig.weight_quant_bits={value!r} is invalid.*Fix: use 8 .* or 4"):
        ZeroConfig(weight_quant_bits=value)


def test_error_feedback_inside_the_node():
    """gradient_error_feedback_intra: needs qgZ (the error names the field and the fix); the
    plan keeps it on one node too (step 1 is then the only hop) and says so; DeepSpeed's
    zeropp_loco_param turns on both hops, as DeepSpeed runs LoCo."""
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    with pytest.raises(ValueError, match=r"ZeroConfig.gradient_error_feedback_intra=True is invalid.*Fix: set "
                                         r"quantized_gradients=True"):
        ZeroConfig(stage=3, gradient_error_feedback_intra=True)
    both = ZeroConfig(stage=3, quantized_gradients=True, gradient_error_feedback=True,
                      gradient_error_feedback_intra=True)
    plan = resolve(both, Topology(world_size=4, rank=0, ranks_per_node=2))
    assert plan.error_feedback and plan.error_feedback_intra
    assert "int4 inside the node with error feedback, 4-bit across with error feedback" in plan.describe()
    one = resolve(both.replace(quantized_gradients_on_single_node=True), Topology(world_size=4, rank=0,
                                                                                 ranks_per_node=4))
    assert (one.error_feedback, one.error_feedback_intra) == (False, True)
    ds = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                          "zeropp_loco_param": {"err_beta": 0.5, "reset_T": 8}}})
    assert (ds.gradient_error_feedback, ds.gradient_error_feedback_intra) == (True, True)
    assert (ds.gradient_error_beta, ds.gradient_error_reset_steps) == (0.5, 8)


def test_2bit_gradient_codes_need_feedback_and_more_bits_inside_the_node():
    """gradient_quant_bits=2: only with error feedback (what the codes drop goes with the next
    step), and only across nodes (the intra-node hop names its own bits)."""
    from zeropp_strategy.plan import resolve
    from zeropp_strategy.topology import Topology

    ok = ZeroConfig(stage=3, quantized_gradients=True, gradient_error_feedback=True, gradient_quant_bits=2,
                    gradient_quant_bits_intra=8)
    plan = resolve(ok, Topology(world_size=4, rank=0, ranks_per_node=2))
    assert (plan.gradient_bits, plan.gradient_bits_inside) == (2, 8)
    with pytest.raises(ValueError, match=r"ZeroConfig.gradient_quant_bits=2 is invalid.*2 only with "
                                         r"gradient_error_feedback=True"):
        ZeroConfig(stage=3, quantized_gradients=True, gradient_quant_bits=2, gradient_quant_bits_intra=8)
    with pytest.raises(ValueError, match=r"ZeroConfig.gradient_quant_bits_intra=None is invalid.*Fix: set "
                                         r"gradient_quant_bits_intra=8"):
        ZeroConfig(stage=3, quantized_gradients=True, gradient_error_feedback=True, gradient_quant_bits=2)
    with pytest.raises(ValueError, match=r"ZeroConfig.gradient_quant_bits_intra=2 is invalid"):
        ok.replace(gradient_quant_bits_intra=2)


def test_frozen_weight_bits_from_yaml_and_deepspeed(tmp_path):
    path = tmp_path / "z.yaml"
    path.write_text("zero:\n  quantize_frozen_weights: true\n  frozen_weight_bits: 4\n")
    assert ZeroConfig.coerce(path) == ZeroConfig(quantize_frozen_weights=True, frozen_weight_bits=4)
    # DeepSpeed has no key for the width (its nontrainable weights are int8): 8, or set it after.
    ds = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}})
    assert ds.frozen_weight_bits == 8 and ds.replace(frozen_weight_bits=4).frozen_weight_bits == 4

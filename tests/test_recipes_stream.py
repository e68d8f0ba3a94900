"""The recipes load published folders shard by shard ([Note: recipes on the meta device] in
zeropp_strategy/rlhf/models.py).

    pytest tests/test_recipes_stream.py -q

``SFTModule`` and ``PPOModule`` get folders (a causal LM's, and a ``ScalarHeadModel``'s
written as ``export_scalar_model`` writes one) under the Trainer on 2 gloo ranks, at stage 3
(the networks built on the meta device and filled from the files after sharding) and at
stage 1 (built for real by transformers, the reference). Checked: the networks were on meta
at the end of ``configure_model`` at stage 3 and real at stage 1; the first SFT loss (LoRA's
B starts at zero, so it is the base model's) is the same; the frozen base after training,
the reward model, the critic's and the reward model's heads and bodies equal the files bit
for bit; PPO's EMA actor starts equal to the actor (its LoRA A included) at both stages;
``SFTModule(dtype="float32")`` holds the bf16 folder's weights as fp32, equal to the files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(300)

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
SHAPE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def _folders(root: Path) -> tuple[Path, Path]:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeropp_strategy.rlhf.models import HEAD_FILE, STATS_FILE, ScalarHeadModel

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False))
    lm.to(torch.bfloat16).save_pretrained(root / "lm", max_shard_size="60KB")
    scalar = ScalarHeadModel({"model_type": "llama", **SHAPE})
    scalar.backbone.save_pretrained(root / "rm")
    save_file({"weight": scalar.head.weight.detach().contiguous()}, str(root / "rm" / HEAD_FILE))
    (root / "rm" / STATS_FILE).write_text(json.dumps({"mean": 0.25, "std": 2.0}))
    return root / "lm", root / "rm"


def _worker(rank: int, world: int, lm: str, rm: str) -> dict:
    import lightning.pytorch as L

    import zeropp_strategy
    from tests._models import trainer_kwargs
    from zeropp_strategy.engine.state import full_model_state
    from zeropp_strategy.recipes import PPOModule, SFTModule

    def on_meta(net) -> bool:
        return any(p.is_meta for p in net.parameters())

    class SFT(SFTModule):
        def configure_model(self) -> None:
            super().configure_model()
            self.built_on_meta = on_meta(self.model)

    class PPO(PPOModule):
        def configure_model(self) -> None:
            super().configure_model()
            self.built_on_meta = {n: on_meta(getattr(self, n)) for n in ("actor", "ema_actor", "critic", "reward_model")}

        def on_fit_start(self) -> None:  # collective: every rank gathers
            self.start = {n: full_model_state(getattr(self, n)) for n in ("actor", "ema_actor", "critic",
                                                                           "reward_model")}
            self.start["reward_stats"] = dict(self.reward_model.reward_stats)

    class FirstLoss(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if batch_idx == 0:
                module.first_loss = float(outputs["loss"])

    out = {}
    for stage in (1, 3):
        torch.manual_seed(0)
        sft = SFT(model=lm, lora=LORA, batch_size=4, max_length=32, lr=1e-3)
        trainer = L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(stage=stage), callbacks=[FirstLoss()],
                            **trainer_kwargs(world, max_steps=2))
        trainer.fit(sft)
        state = full_model_state(sft.model)
        torch.manual_seed(0)
        ppo = PPO(actor=lm, reward_model=rm, lora=LORA, ema_decay=0.9, rollout_batch_size=4, mini_batch_size=2)
        L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(stage=stage), **trainer_kwargs(world, max_steps=0)).fit(ppo)
        # dtype: fp32 weights from the bf16 folder, converted tensor by tensor as they are read
        fp32 = SFT(model=lm, dtype="float32", batch_size=4, max_length=32)
        L.Trainer(strategy=zeropp_strategy.ZeroPPStrategy(stage=stage), **trainer_kwargs(world, max_steps=0)).fit(fp32)
        out[stage] = {"sft_meta": sft.built_on_meta, "sft_loss": sft.first_loss,
                      "sft_base": {k: v for k, v in state.items() if "lora" not in k},
                      "ppo_meta": ppo.built_on_meta, "ppo": ppo.start,
                      "fp32_meta": fp32.built_on_meta, "fp32": full_model_state(fp32.model)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    lm, rm = _folders(tmp_path_factory.mktemp("folders"))
    return lm, rm, run_ranks(_worker, 2, (str(lm), str(rm)), timeout_s=240)[0]


def test_folders_are_built_on_meta_at_stage_3_and_for_real_at_stage_1(runs) -> None:
    _, _, out = runs
    assert out[3]["sft_meta"] and all(out[3]["ppo_meta"].values()) and out[3]["fp32_meta"], out[3]
    assert not out[1]["sft_meta"] and not any(out[1]["ppo_meta"].values()) and not out[1]["fp32_meta"], out[1]


def test_the_streamed_base_equals_the_files(runs) -> None:
    from safetensors.torch import load_file

    lm, _, out = runs
    files = {}
    for f in lm.glob("*.safetensors"):
        files.update(load_file(str(f)))
    # the base loaded at stage 1 by transformers, at stage 3 shard by shard: the first loss
    # is the base model's (LoRA's B is zero), and the frozen base is the files' after training
    assert out[3]["sft_loss"] == pytest.approx(out[1]["sft_loss"], rel=1e-5, abs=1e-6)
    for stage in (1, 3):
        base = out[stage]["sft_base"]
        for k, want in files.items():
            got = base["base_model.model." + k.replace(".weight", ".base_layer.weight")
                       if k.split(".")[-2] in LORA["target_modules"] else "base_model.model." + k]
            assert got.dtype == want.dtype and torch.equal(got, want), (stage, k)
        # SFTModule(dtype="float32") on the bf16 folder: every weight fp32, equal to the file's
        fp32 = out[stage]["fp32"]
        assert set(fp32) == set(files), sorted(set(fp32) ^ set(files))[:4]
        for k, want in files.items():
            assert fp32[k].dtype == torch.float32 and torch.equal(fp32[k], want.float()), (stage, k)


def test_scalar_heads_and_the_ema_start_as_they_should(runs) -> None:
    from safetensors.torch import load_file

    from zeropp_strategy.rlhf.models import HEAD_FILE

    _, rm, out = runs
    head = load_file(str(rm / HEAD_FILE))["weight"]
    body = load_file(str(rm / "model.safetensors"))
    for stage in (1, 3):
        start = out[stage]["ppo"]
        assert start["reward_stats"] == {"mean": 0.25, "std": 2.0}
        for net in ("critic", "reward_model"):
            assert torch.equal(start[net]["head.weight"], head.to(start[net]["head.weight"].dtype)), (stage, net)
            for k, want in body.items():
                assert torch.equal(start[net]["backbone." + k], want), (stage, net, k)
        actor, ema = start["actor"], start["ema_actor"]
        assert actor.keys() == ema.keys() and any("lora_A" in k for k in actor)
        for k in actor:
            assert torch.equal(actor[k], ema[k]), (stage, k)


def test_a_bad_dtype_names_the_field_and_the_fix_before_any_network_is_built() -> None:
    from zeropp_strategy.recipes import GRPOModule, PPOModule, SFTModule

    for module in (SFTModule, PPOModule, GRPOModule):
        with pytest.raises(ValueError, match=r"dtype='int8' is invalid: must be one of \['bf16', 'fp16', 'fp32'\]"):
            module(dtype="int8")


def test_scalar_head_model_takes_the_dtype_for_body_and_head() -> None:
    from zeropp_strategy.rlhf.models import ScalarHeadModel

    model = ScalarHeadModel({"model_type": "llama", **SHAPE}, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert ScalarHeadModel({"model_type": "llama", **SHAPE}).head.weight.dtype == torch.float32

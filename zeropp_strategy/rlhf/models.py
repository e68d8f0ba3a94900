"""Layer: recipes (rlhf). Building the policy and reward networks: from a local ``from_pretrained`` folder, a
hub name, or a transformers config dict (the embedded default trains from scratch).

All of it runs inside ``LightningModule.configure_model`` so that ``zeropp`` at stages 2/3
can create the model on the meta device and materialize only each rank's shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from zeropp_strategy.checkpoint.consolidate import weights_dtype
from zeropp_strategy.engine.pretrained import fill_from_file, from_pretrained
from zeropp_strategy.rlhf.ops import last_index

__all__ = ["HEAD_FILE", "STATS_FILE", "ScalarHead", "ScalarHeadModel", "apply_lora", "build_causal_lm", "build_tokenizer",
           "disable_dropout",
           "positions", "tiny_llama_config"]

# A ScalarHeadModel folder (written by export.export_scalar_model): the backbone's
# save_pretrained output plus these two files.
HEAD_FILE = "value_head.safetensors"
STATS_FILE = "reward_stats.json"


def positions(attention_mask: Tensor) -> Tensor:
    """Position ids that count only real tokens: a left-padded row starts at 0 at its first
    real token, as in generation. Every forward of a padded batch passes them, so the
    log-probs recomputed for PPO match the ones sampled."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def tiny_llama_config(**overrides: Any) -> dict[str, Any]:
    """The embedded default: a small Llama-style config over ByT5's 384 byte ids."""
    cfg = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 384, "max_position_embeddings": 64,
           "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 1}
    cfg.update(overrides)
    return cfg


def _config(spec: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    spec = dict(spec)
    model_type = spec.pop("model_type", None)
    if model_type is None:
        raise ValueError("model config dict has no 'model_type'. Fix: add e.g. model_type: llama to the recipe.")
    return AutoConfig.for_model(model_type, **spec)


def _dtype_kwargs(dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """The weights' dtype for ``from_config``/``from_pretrained``: nothing when not asked
    for (the model's own), else ``dtype=`` (transformers >= 4.56; ``torch_dtype=`` before,
    now deprecated)."""
    if dtype is None:
        return {}
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}


def build_causal_lm(model: str | dict[str, Any], *, dtype: torch.dtype | str | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` from a local folder or hub name, or from scratch from a config
    dict. [Note: recipes on the meta device]: from a folder, inside the strategy's meta
    build (``configure_model`` at stages 2/3) the model is a skeleton that each rank fills
    with its own shard (``zeropp_strategy.from_pretrained``); from a config dict it is built
    for real on every rank, so that a copy of it (the reference policy) starts with its values.
    ``dtype`` (a torch dtype or a name such as ``"bf16"``): the weights' dtype, converted
    tensor by tensor as they are read; ``None``: the folder's own (fp32 from a config dict)."""
    from transformers import AutoModelForCausalLM

    dtype = weights_dtype(dtype)
    if isinstance(model, dict):
        with torch.device("cpu"):  # the innermost device context wins over the strategy's meta one
            return AutoModelForCausalLM.from_config(_config(model), **_dtype_kwargs(dtype))
    return from_pretrained(_local(model), dtype=dtype)


def _local(name: str) -> str:
    """A local folder as given; a hub name as the folder of its cached snapshot
    (``config.json`` and the safetensors, downloaded once if not cached), which the streaming
    load reads by rows."""
    if Path(name).is_dir() or not torch.empty(0).is_meta:
        return name
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors"])


def disable_dropout(model: nn.Module) -> nn.Module:
    """Turn every dropout of ``model`` off for good, in train mode too: ``p = 0`` on each
    ``nn.Dropout`` (peft's ``lora_dropout`` included) and ``0.0`` for the float
    ``attention_dropout`` that Hugging Face attention modules pass to SDPA. RLHF
    recomputes log-probs and values that must equal the sampled ones, so its networks
    must not drop anything; doing it here rather than with ``eval()`` keeps them in the
    train mode Lightning expects (it warns about modules in eval mode at the start of
    training). Returns ``model``."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def apply_lora(model: nn.Module, lora: dict[str, Any] | None) -> nn.Module:
    """peft LoRA adapters from a recipe's ``lora:`` block (``peft.LoraConfig`` fields, e.g.
    ``{r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}``): base weights frozen,
    adapters trained. ``None`` returns the model unchanged. With ZeroConfig's
    ``quantize_frozen_weights`` the frozen base is stored as int8 shards at stage 3."""
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    try:
        config = LoraConfig(**lora)
    except TypeError as e:
        raise ValueError(f"lora={lora!r} is invalid: {e}. Fix: use peft.LoraConfig field names "
                         "(r, lora_alpha, lora_dropout, target_modules, ...).") from None
    return get_peft_model(model, config)


def merged(model: nn.Module) -> nn.Module:
    """The plain transformers model to export: LoRA adapters merged into the base."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def build_tokenizer(name: str | None) -> Any:
    """A tokenizer from a folder/hub name; ``None`` or ``"byt5"``: transformers' byte-level
    ByT5 tokenizer, which needs no vocabulary files (the embedded default)."""
    if name in (None, "byt5"):
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if tok.pad_token is None:  # masks come from lengths, so a pad equal to EOS is harmless
        tok.pad_token = tok.eos_token
    return tok


class ScalarHead(nn.Linear):
    """The scalar head: ``hidden -> 1``, no bias, drawn from N(0, 1 / (hidden + 1)). The draw
    is its ``reset_parameters``, so a head built on the meta device gets it when the strategy
    materializes it (after nn.Linear's own, so a real build draws exactly as it always has)."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden, 1, bias=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.normal_(self.weight, std=1.0 / (self.in_features + 1) ** 0.5)


class ScalarHeadModel(nn.Module):
    """A transformer backbone with a linear scalar head: the reward model and the critic.
    ``dtype`` as in ``build_causal_lm``: the body built from a folder or a config, and the
    head; a body passed as a module is kept as it is.

    ``forward`` returns the per-token values ``[batch, time]``; ``score`` the value at
    each row's last real token, found from the attention mask (left or right padding).
    """

    def __init__(self, model: str | dict[str, Any] | nn.Module, *, dtype: torch.dtype | str | None = None) -> None:
        super().__init__()
        from transformers import AutoModel

        dtype = weights_dtype(dtype)
        if isinstance(model, nn.Module):
            self.backbone = model
        elif isinstance(model, dict):
            with torch.device("cpu"):  # built for real, as build_causal_lm builds a config dict
                self.backbone = AutoModel.from_config(_config(model), **_dtype_kwargs(dtype))
        else:  # a causal LM's folder (the SFT output) or a ScalarHeadModel's: the body without a head
            model = _local(model)
            self.backbone = from_pretrained(model, auto_class=AutoModel, dtype=dtype)
        with torch.device(next(self.backbone.parameters()).device):  # on meta with a streamed backbone
            self.head = ScalarHead(self.backbone.config.hidden_size)
        if dtype is not None:  # asked for: the head too (else fp32, whatever the body's dtype)
            self.head.to(dtype)
        #: the score mean and std of the reward model's validation (for PPO's normalisation)
        self.reward_stats: dict[str, float] = {"mean": 0.0, "std": 1.0}
        if isinstance(model, str):
            self._load_head(Path(model))

    def _load_head(self, folder: Path) -> None:
        """A folder written by ``export_scalar_model`` carries the trained head and the
        statistics; a plain causal-LM folder (the SFT output) gets a fresh head. A head on
        the meta device is filled from the file when the strategy materializes it."""
        if (folder / HEAD_FILE).is_file() and not fill_from_file(self.head, folder / HEAD_FILE):
            from safetensors.torch import load_file

            with torch.no_grad():
                self.head.weight.copy_(load_file(str(folder / HEAD_FILE))["weight"])
        if (folder / STATS_FILE).is_file():
            self.reward_stats = {k: float(v) for k, v in json.loads((folder / STATS_FILE).read_text()).items()}

    @classmethod
    def from_causal_lm(cls, lm: nn.Module) -> ScalarHeadModel:
        """The LM's transformer body (e.g. the SFT model's) under a fresh head."""
        return cls(lm.get_decoder() if hasattr(lm, "get_decoder") else lm.base_model)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = positions(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids).last_hidden_state
        # copy=True: values of their own, not a view of the head's [batch, time, 1] output,
        # even in fp32 (see [Note: root outputs are not views] in engine/fsdp.py: under
        # Fabric or Accelerate this model can be the FSDP root).
        return self.head(hidden).squeeze(-1).to(torch.float32, copy=True)

    def score(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None) -> Tensor:
        values = self(input_ids, attention_mask, position_ids)
        last = last_index(attention_mask)
        return values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)

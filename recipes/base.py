"""Layer: recipes. What ``SFTModule``, ``RewardModule`` and ``DPOModule`` share: their
common arguments (documented once, on ``DatasetModule``), records split into train and
validation, AdamW, the Hugging Face export at the end of ``fit``, and (for the two trained
on preference pairs) the pair loaders.

Each module builds its networks in ``configure_model`` (meta-device friendly under
``zeropp``), runs under any Lightning strategy, and reads its data through ``rlhf.data``.
Every hyper-parameter is an ``__init__`` argument, so LightningCLI recipes can set and
override all of them. Moved here from ``zeropp_strategy.rlhf.modules`` (that path was removed: docs/changes.md).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from zeropp_strategy.rlhf.data import EvalShard, PairCollator, load_records
from zeropp_strategy.toolkit import weights_dtype
from zeropp_strategy.rlhf.models import build_tokenizer, tiny_llama_config

__all__ = ["DatasetModule", "PairDatasetModule"]


class DatasetModule(LightningModule):
    """A module trained on records (``rlhf.data.load_records``): the train/validation
    split (seeded), AdamW over the trainable parameters, and ``export_hf`` at the end of
    ``fit`` when ``export_dir`` is set. Subclasses build the model and the loaders.

    The arguments below are those of ``SFTModule``, ``RewardModule`` and ``DPOModule`` alike,
    documented here once. Each subclass lists them in its own ``__init__`` signature, with
    its own defaults, and hands them on in one line, ``super().__init__(**self.shared(locals()))``,
    before its own ``save_hyperparameters()``. The signature stays whole because LightningCLI
    (types, per-class defaults, this help), the unknown-key checks of ``zeropp fit`` and
    ``zeropp pipeline`` (``errors.check_arguments``) and ``save_hyperparameters`` read it:
    behind a ``**kwargs`` the CLI would show the defaults of one class, the checks would
    accept any key and the hyper-parameters would miss the arguments left at their defaults.
    The values are the ones the subclass passes on, so a subclass of a recipe may change an
    argument before handing it over.

    Args:
        model: a ``from_pretrained`` folder or hub name, or a transformers config dict
            (trained from scratch). ``None``: the embedded tiny Llama.
        tokenizer: a folder/hub name, or ``None``/``"byt5"`` (byte-level, no files).
        data: a ``.jsonl`` file, a ``datasets`` name, or ``"embedded:addition"``.
        batch_size: records per process and step (preference pairs for the modules
            trained on pairs).
        max_length: tokens per sequence, prompt and response (a longer one loses the start
            of its prompt).
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        val_fraction: part of the records held out for validation, in [0, 1).
        seed: the train/validation split and the shuffling.
        export_dir: at the end of ``fit`` the model is written there as a Hugging Face
            folder (``from_pretrained``-loadable, LoRA merged), with the tokenizer.
        dtype: the weights' dtype, converted tensor by tensor on load: ``bf16``, ``fp16`` or
            ``fp32`` (or ``bfloat16``, ``float32``, ...; TRL's ``model_init_kwargs.dtype``).
            ``None``: the folder's own (fp32 for a config dict). With ``precision:
            bf16-mixed``, ``fp32`` keeps fp32 master weights of a bf16 folder.
    """

    SHARED = ("model", "tokenizer", "data", "batch_size", "max_length", "lr", "weight_decay", "val_fraction",
              "seed", "export_dir", "dtype")
    """The arguments every subclass takes and this class reads (documented above)."""

    @classmethod
    def shared(cls, values: dict[str, Any]) -> dict[str, Any]:
        """The shared arguments among ``values`` (a subclass's ``locals()`` at the top of its
        ``__init__``)."""
        return {name: values[name] for name in cls.SHARED}

    def __init__(
        self,
        *,
        model: str | dict[str, Any] | None,
        tokenizer: str | None,
        data: str,
        batch_size: int,
        max_length: int,
        lr: float,
        weight_decay: float,
        val_fraction: float,
        seed: int,
        export_dir: str | None = None,
        dtype: str | None = None,
    ) -> None:
        super().__init__()
        self.export_dir = export_dir
        self.model_spec = model if model is not None else tiny_llama_config()
        #: the networks' weights dtype when built (``dtype`` of build_causal_lm), checked here:
        #: a bad name fails on every rank before the Trainer starts
        self.weights_dtype = weights_dtype(dtype)
        self.tokenizer = build_tokenizer(tokenizer)
        self.data, self.batch_size, self.max_length = data, batch_size, max_length
        self.lr, self.weight_decay, self.val_fraction, self.seed = lr, weight_decay, val_fraction, seed
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} is invalid: it must be in [0, 1). Fix: e.g. 0.1.")
        self._train: list[dict[str, str]] | None = None
        self._val: list[dict[str, str]] | None = None

    def _split(self, kind: str) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        if self._train is None:
            records = load_records(self.data, kind=kind)
            g = torch.Generator().manual_seed(self.seed)
            order = torch.randperm(len(records), generator=g).tolist()
            n_val = int(len(records) * self.val_fraction)
            self._val = [records[i] for i in order[:n_val]]
            self._train = [records[i] for i in order[n_val:]]
        assert self._val is not None
        return self._train, self._val

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def on_fit_end(self) -> None:
        if self.export_dir:
            self.export_hf(self.export_dir)

    def export_hf(self, directory: str) -> None:
        """Collective (every rank calls it): the trained model as a Hugging Face folder."""
        raise NotImplementedError


class PairDatasetModule(DatasetModule):
    """Modules trained on preference pairs: chosen rows then rejected rows in one batch.
    Their ``self.log`` calls count pairs (``batch_size=``): Lightning would guess from the
    batch's tensors, which hold two rows per pair and one index per pair."""

    def _loader(self, records: list[dict[str, str]], shuffle: bool) -> DataLoader:
        indexed = [{**r, "__index__": i} for i, r in enumerate(records)]  # for per-record caches
        return DataLoader(indexed, batch_size=self.batch_size, shuffle=shuffle,
                          sampler=None if shuffle else EvalShard(indexed),
                          collate_fn=PairCollator(self.tokenizer, max_length=self.max_length),
                          generator=torch.Generator().manual_seed(self.seed))

    def train_dataloader(self) -> DataLoader:
        return self._loader(self._split("preferences")[0], shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._split("preferences")[1], shuffle=False)

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val")


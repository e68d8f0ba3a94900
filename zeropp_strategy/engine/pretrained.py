"""Layer: engine. Published models loaded shard by shard: each rank reads only its own rows.

    # in configure_model (Lightning) or under fabric.init_module(), at stages 2/3:
    model = zeropp_strategy.from_pretrained("path/to/Llama-3-8B")      # a skeleton on the meta device
    # the strategy shards it; materialize() fills each rank's shard from the files

[Note: streaming load]
``transformers.from_pretrained`` on every rank costs every rank the whole model in host
memory before a single shard exists (8 ranks x 16 GB for an 8B model in bf16). Under the
strategy's meta build (``ZeroConfig.meta_init``, engine/meta_init.py), ``from_pretrained``
here builds the model's skeleton with ``from_config`` on the meta device and remembers the
folder; after sharding, ``materialize`` (engine/fsdp.py) allocates each module's shard and
fills it from the folder instead of drawing random values: a memory-mapped
``safetensors`` slice of the rows this rank owns (FSDP2 shards dim 0 in chunks of
ceil(rows / ranks)), converted to the parameter's dtype, one tensor in flight at a time.
So a rank's peak is its shard plus one tensor's rows. Tensors the files do not hold (the
rotary caches, non-persistent buffers) are computed by the model's ``_init_weights``; a
weight tied to another (``lm_head`` to the embedding) is the same parameter and is filled
once. A frozen weight stored as int8/int4 (``quantize_frozen_weights``) is quantized as its
rows are copied in, so the dense base never exists in host memory.

Everything that can be wrong with the folder is checked when the skeleton is built, on
every rank, before the first collective: no ``config.json``, no ``.safetensors`` files, a
file named by the index that is missing, truncated or unreadable, a tensor whose shape
disagrees with the model, keys the model does not have or keys it needs that the files do
not hold. Each is a ``UsageError`` naming the folder, the file and the tensor.
Outside a meta build (stage 1, DDP, one process) ``from_pretrained`` is transformers' own.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp_strategy.errors import MissingPathError, UsageError

__all__ = ["Loads", "PretrainedFolder", "from_pretrained", "tied_aliases"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# keys old checkpoints carry that current models compute instead (transformers ignores them too)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_SOURCES: weakref.WeakKeyDictionary[nn.Module, PretrainedFolder] = weakref.WeakKeyDictionary()


class PretrainedFolder:
    """The tensors of a ``from_pretrained`` folder of safetensors files, read by rows."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingPathError(f"from_pretrained({str(path)!r}): no such folder",
                                   "pass a local folder written by save_pretrained (config.json and .safetensors)")
        if not (self.path / "config.json").is_file():
            raise MissingPathError(f"from_pretrained({str(path)!r}): the folder has no config.json",
                                   "pass the folder save_pretrained wrote (config.json beside the weights)")
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise UsageError(f"from_pretrained({str(path)!r}): {INDEX} has no weight_map",
                                 "re-save the model with save_pretrained")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).is_file():
            weight_map, files = None, [SINGLE]
        else:
            raise MissingPathError(f"from_pretrained({str(path)!r}): no {SINGLE} or {INDEX} in the folder",
                                   "save the model with save_pretrained(safe_serialization=True); .bin weights are "
                                   "not read shard by shard")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        for name in files:
            handle = self._open(name)
            for key in handle.keys():
                self.file_of[key] = name
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
        if weight_map is not None:
            lost = sorted(k for k, f in weight_map.items() if self.file_of.get(k) != f)
            if lost:
                raise UsageError(f"from_pretrained({str(path)!r}): {INDEX} names {len(lost)} tensors its files do not "
                                 f"hold, first {lost[0]!r} in {weight_map[lost[0]]}",
                                 "re-download or re-save the model: a shard file is incomplete")

    def _open(self, name: str) -> Any:
        from safetensors import safe_open

        handle = self._handles.get(name)
        if handle is None:
            file = self.path / name
            if not file.is_file():
                raise MissingPathError(f"from_pretrained({str(self.path)!r}): {name}, named by {INDEX}, is missing",
                                       "re-download or re-save the model: a shard file is missing")
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a bad header
                raise UsageError(f"from_pretrained({str(self.path)!r}): {name} cannot be read ({e})",
                                 "re-download or re-save the model: the file is truncated or damaged") from e
            self._handles[name] = handle
        return handle

    def read(self, key: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (a 0-dim tensor whole), as ``dtype``."""
        name = self.file_of[key]
        piece = self._open(name).get_slice(key)
        try:
            rows = piece[start:stop] if self.shapes[key] else piece[...]
        except Exception as e:  # a file shorter than its header says
            raise UsageError(f"from_pretrained({str(self.path)!r}): {name}: tensor {key!r} cannot be read ({e})",
                             "re-download or re-save the model: the file is truncated or damaged") from e
        return rows.to(dtype)

    def check(self, model: nn.Module) -> None:
        """The folder's tensors against ``model`` (a skeleton): every persistent tensor the
        model has must be in the files with its shape, and no file tensor may be unknown."""
        expected = dict(model.state_dict(keep_vars=True).items())
        tied = tied_aliases(model)
        need = {k: tuple(v.shape) for k, v in expected.items() if k not in tied}
        missing = sorted(k for k in need if k not in self.shapes)
        unexpected = sorted(k for k in self.shapes if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
        wrong = [f"{k}: {self.shapes[k]} in {self.file_of[k]}, the model has {need[k]}" for k in need
                 if k in self.shapes and self.shapes[k] != need[k]]
        where = f"from_pretrained({str(self.path)!r})"
        if wrong:
            raise UsageError(f"{where}: {len(wrong)} tensors disagree with the model's config, first {wrong[0]}",
                             "check that config.json belongs to these weights")
        if missing:
            raise UsageError(f"{where}: the files lack {len(missing)} tensors the model needs: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}",
                             "re-save the complete model, or load it with the matching model class")
        if unexpected:
            raise UsageError(f"{where}: the files hold {len(unexpected)} tensors the model does not have: "
                             f"{', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}",
                             "load it with the model class it was saved from (auto_class=...)")


def tied_aliases(skeleton: nn.Module) -> set[str]:
    """State-dict keys that alias another key (tied weights): the ones ``save_pretrained``
    leaves out, as transformers decides (its ``remove_tied_weights_from_state_dict``; older
    transformers: the later name of each shared tensor)."""
    sd = skeleton.state_dict()
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        return set(sd) - set(remove_tied_weights_from_state_dict(dict(sd), skeleton))
    except ImportError:
        seen: set[int] = set()
        aliases = set()
        for name, t in skeleton.state_dict(keep_vars=True).items():
            if id(t) in seen:
                aliases.add(name)
            seen.add(id(t))
        return aliases


def from_pretrained(path: str | Path, *, auto_class: Any = None, dtype: torch.dtype | None = None,
                    **config_kwargs: Any) -> nn.Module:
    """A Hugging Face model from a local ``save_pretrained`` folder. Under the strategy's meta
    build (``configure_model``/``init_module`` at stages 2/3): its skeleton on the meta device,
    checked against the folder, filled shard by shard after sharding ([Note: streaming
    load]); elsewhere: ``auto_class.from_pretrained(path, dtype=dtype)``. ``auto_class``:
    default ``transformers.AutoModelForCausalLM``; ``config_kwargs`` go to ``AutoConfig``."""
    import transformers

    auto_class = auto_class or transformers.AutoModelForCausalLM
    dtype_kw = {"dtype": dtype} if dtype is not None else {}
    if not torch.empty(0).is_meta:
        return auto_class.from_pretrained(str(path), **dtype_kw, **config_kwargs)
    folder = PretrainedFolder(path)
    config = transformers.AutoConfig.from_pretrained(str(path), **config_kwargs)
    model = auto_class.from_config(config, **dtype_kw)
    folder.check(model)
    _SOURCES[model] = folder
    return model


class Loads:
    """What ``materialize`` reads from folders for the modules under ``root``: the modules of
    every model ``from_pretrained`` built on meta, each with its folder and key prefix."""

    def __init__(self, root: nn.Module) -> None:
        self.by_module: dict[int, tuple[PretrainedFolder, str]] = {}
        self.done: set[int] = set()  # tensors filled already (a tied weight is reached twice)
        for model in root.modules():
            folder = _SOURCES.get(model)
            if folder is not None:
                for name, sub in model.named_modules(remove_duplicate=False):
                    self.by_module.setdefault(id(sub), (folder, f"{name}." if name else ""))

    def _own(self, m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [*m._parameters.items(), *m._buffers.items()]

    @staticmethod
    def _key(folder: PretrainedFolder, key: str) -> str:
        """The file's name for a tensor: peft's LoRA layers move a base weight from
        ``q_proj.weight`` to ``q_proj.base_layer.weight``."""
        return key if key in folder.shapes else key.replace(".base_layer.", ".")

    def init_needed(self, m: nn.Module) -> bool:
        """Whether ``m`` needs its initialization: it is not from a folder, or some tensor of
        its own is neither in the files nor filled already (a rotary cache, say)."""
        src = self.by_module.get(id(m))
        if src is None:
            return True
        folder, prefix = src
        return any(t is not None and id(t) not in self.done and self._key(folder, prefix + n) not in folder.shapes
                   for n, t in self._own(m))

    def fill(self, m: nn.Module) -> None:
        """Copy ``m``'s tensors that the files hold into this rank's shards."""
        src = self.by_module.get(id(m))
        if src is None:
            return
        folder, prefix = src
        for name, t in self._own(m):
            key = self._key(folder, prefix + name)
            if t is None or id(t) in self.done or key not in folder.shapes:
                continue
            _fill(t, folder, key)
            self.done.add(id(t))


@torch.no_grad()
def _fill(t: torch.Tensor, folder: PretrainedFolder, key: str) -> None:
    """This rank's rows of ``key`` into ``t``: FSDP2's dim-0 shard (chunks of ceil(rows /
    ranks), the last ones shorter or empty) or the whole tensor."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(t, DTensor):
        local = t.to_local()
        if tuple(t.placements) != (Shard(0),):
            raise NotImplementedError(f"from_pretrained: {key} is sharded as {t.placements}; streaming load reads "
                                      "dim-0 shards on a 1-D mesh (FSDP2's layout)")
        rows, ranks = t.shape[0], t.device_mesh.size()
        chunk = -(-rows // ranks)
        start = min(t.device_mesh.get_local_rank() * chunk, rows)
        stop = start + local.shape[0]
        if stop > start:
            local.copy_(folder.read(key, start, stop, local.dtype))
    else:
        t.copy_(folder.read(key, 0, t.shape[0] if t.dim() else 0, t.dtype))

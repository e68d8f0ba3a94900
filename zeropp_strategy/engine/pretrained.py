"""Layer: engine. Published models loaded shard by shard: each rank reads only its own rows.

    # in configure_model (Lightning) or under fabric.init_module(), at stages 2/3:
    model = zeropp_strategy.from_pretrained("path/to/Llama-3-8B")      # a skeleton on the meta device
    # the strategy shards it; materialize() fills each rank's shard from the files

[Note: streaming load]
``transformers.from_pretrained`` on every rank costs every rank the whole model in host
memory before a single shard exists (8 ranks x 16 GB for an 8B model in bf16). Under the
strategy's meta build (``ZeroConfig.meta_init``, engine/meta_init.py), ``from_pretrained``
here builds the model's skeleton with ``from_config`` on the meta device and remembers the
folder; after sharding, ``materialize`` (engine/materialize.py) allocates each module's shard and
fills it from the folder instead of drawing random values: the rows this rank owns (FSDP2
shards dim 0 in chunks of ceil(rows / ranks)), a view of the memory-mapped ``safetensors``
file converted to the parameter's dtype as it is copied into the shard, one tensor in
flight at a time. A mapped file's pages count in the rank's resident memory once touched
(3 GiB more per rank than its shard at 2.7B, docs/pretrained.md), so before reading the
next tensor the rank tells the kernel it no longer needs the last one's pages
(``MADV_DONTNEED``; they stay in the page cache). So a rank's peak is its shard plus one
tensor's rows. The mapping is read-only: a private (copy-on-write) one would be charged
to the machine's commit limit for the whole file on every rank. Tensors the files do not hold (the
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
import math
import mmap
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp_strategy.engine.meta_init import RANK0_VALUES_ATTR, has_meta, values_come_from_rank0
from zeropp_strategy.errors import MissingPathError, UsageError

__all__ = ["Loads", "PretrainedFolder", "copy_on_materialize", "fill_from_file", "from_pretrained", "tied_aliases"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
           "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
           "F8_E5M2FNUZ": torch.float8_e5m2fnuz}
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# keys old checkpoints carry that current models compute instead (transformers ignores them too)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# every module of a model built on meta from files -> (its files, the prefix of its tensors' names there)
_SOURCES: weakref.WeakKeyDictionary[nn.Module, tuple[PretrainedFolder, str]] = weakref.WeakKeyDictionary()
# every module of a copy_on_materialize copy -> the module it copies
_COPIES: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


class PretrainedFolder:
    """The tensors of a ``from_pretrained`` folder of safetensors files, read by rows;
    ``files``: only these files of the folder, which then needs no ``config.json`` (a
    scalar head's own file, say)."""

    def __init__(self, path: str | Path, files: list[str] | None = None) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise MissingPathError(f"from_pretrained({str(path)!r}): no such folder",
                                   "pass a local folder written by save_pretrained (config.json and .safetensors)")
        weight_map = None
        if files is None:
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
                files = [SINGLE]
            else:
                raise MissingPathError(f"from_pretrained({str(path)!r}): no {SINGLE} or {INDEX} in the folder",
                                       "save the model with save_pretrained(safe_serialization=True); .bin weights "
                                       "are not read shard by shard")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.file_of: dict[str, str] = {}
        self._entries: dict[str, tuple[torch.dtype, int]] = {}  # key -> (dtype, byte offset in its file)
        self._files: dict[str, mmap.mmap] = {}  # name -> its mapping, while reading
        self._last: tuple[mmap.mmap, int, int] | None = None  # the last read's mapping, offset and bytes
        for name in files:
            for key, (dtype, shape, offset) in self._header(name).items():
                self.file_of[key] = name
                self.shapes[key] = shape
                self._entries[key] = (dtype, offset)
        if weight_map is not None:
            lost = sorted(k for k, f in weight_map.items() if self.file_of.get(k) != f)
            if lost:
                raise UsageError(f"from_pretrained({str(path)!r}): {INDEX} names {len(lost)} tensors its files do not "
                                 f"hold, first {lost[0]!r} in {weight_map[lost[0]]}",
                                 "re-download or re-save the model: a shard file is incomplete")

    def _header(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
        """The tensors of safetensors file ``name`` (dtype, shape, offset of their bytes),
        checked against the file's size: a file shorter than its header says fails here,
        before anything is read."""
        file = self.path / name
        if not file.is_file():
            raise MissingPathError(f"from_pretrained({str(self.path)!r}): {name}, named by {INDEX}, is missing",
                                   "re-download or re-save the model: a shard file is missing")
        where, fix = f"from_pretrained({str(self.path)!r}): {name}", "re-download or re-save the model: the file is " \
            "truncated or damaged"
        size = file.stat().st_size
        try:
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 2 <= n <= min(size - 8, _MAX_HEADER_BYTES):
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
            out = {}
            for key, entry in header.items():
                if key == "__metadata__":
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise UsageError(f"{where}: tensor {key!r} has dtype {entry['dtype']}, which this loader does not "
                                     f"read", "convert the model to one of " + ", ".join(_DTYPES))
                dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
                if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)) or (
                        end - begin != math.prod(shape) * dtype.itemsize or 8 + n + end > size):
                    raise ValueError(f"tensor {key!r}: shape {list(shape)} at bytes {begin}-{end} after the header, "
                                     f"in a file of {size} bytes")
                out[key] = (dtype, shape, 8 + n + begin)
        except UsageError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a bad header, a short file
            raise UsageError(f"{where} cannot be read ({type(e).__name__}: {e})", fix) from e
        return out

    def close(self) -> None:
        """Unmap the files (read again later, they are mapped again)."""
        self._release()
        self._files.clear()

    def _release(self) -> None:
        """Drop the pages the last ``read`` touched from this rank's resident memory (they stay
        in the page cache): each rank's RSS holds one tensor's rows of the files at most."""
        if self._last is not None:
            mapping, begin, length = self._last
            first = begin // mmap.PAGESIZE * mmap.PAGESIZE
            if hasattr(mmap, "MADV_DONTNEED"):  # not on Windows, where the pages stay until close()
                mapping.madvise(mmap.MADV_DONTNEED, first, begin + length - first)
            self._last = None

    def read(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (a 0-dim tensor whole), in the file's dtype,
        a view of the mapped file valid until the next ``read``: the caller's ``copy_``
        converts while it copies (one pass, no converted temporary). Its pages leave this
        rank's resident memory at the next ``read`` ([Note: streaming load])."""
        self._release()
        dtype, offset = self._entries[key]
        shape = self.shapes[key]
        row = math.prod(shape[1:]) * dtype.itemsize
        rows = stop - start if shape else 1
        if rows * row == 0:  # no bytes: frombuffer refuses a count of 0
            return torch.empty((rows, *shape[1:]) if shape else (), dtype=dtype)
        name = self.file_of[key]
        mapping = self._files.get(name)
        if mapping is None:
            with open(self.path / name, "rb") as f:
                mapping = self._files[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        begin = offset + start * row
        self._last = (mapping, begin, rows * row)
        with warnings.catch_warnings():  # the view is only ever read (copied from): a read-only mapping is
            warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)  # what it needs
            out = torch.frombuffer(mapping, dtype=torch.uint8, count=rows * row, offset=begin)
        if begin % dtype.itemsize:  # a file that does not align its tensors
            out = out.clone()
        out = out.view(dtype)
        return out.view(rows, *shape[1:]) if shape else out.view(())

    def check(self, model: nn.Module) -> str:
        """The folder's tensors against ``model`` (a skeleton): every persistent tensor the
        model has must be in the files with its shape, and no file tensor may be unknown.
        Returns the prefix of the model's names in the files: ``""``, or for a base model
        (``AutoModel``) read from a folder that holds it under a task head (a causal LM's
        folder), its ``base_model_prefix`` and a dot; the head's tensors are then left
        unread, as transformers leaves them."""
        expected = dict(model.state_dict(keep_vars=True).items())
        tied = tied_aliases(model)
        need = {k: tuple(v.shape) for k, v in expected.items() if k not in tied}
        prefix, base = "", getattr(model, "base_model_prefix", "")
        if base and not any(k in self.shapes for k in need) and any(f"{base}.{k}" in self.shapes for k in need):
            prefix = f"{base}."
        shapes = {k[len(prefix):]: v for k, v in self.shapes.items() if k.startswith(prefix)}
        missing = sorted(k for k in need if k not in shapes)
        unexpected = sorted(k for k in shapes if k not in expected and not k.endswith(_IGNORED_SUFFIXES))
        wrong = [f"{k}: {shapes[k]} in {self.file_of[prefix + k]}, the model has {need[k]}" for k in need
                 if k in shapes and shapes[k] != need[k]]
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
        return prefix


def tied_aliases(skeleton: nn.Module) -> set[str]:
    """State-dict keys that alias another key (tied weights): the ones ``save_pretrained``
    leaves out, as transformers decides (its ``remove_tied_weights_from_state_dict``; older
    transformers, or a module that is not a transformers model: the later name of each
    shared tensor)."""
    sd = skeleton.state_dict()
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is not None and isinstance(skeleton, PreTrainedModel):
        return set(sd) - set(remove_tied_weights_from_state_dict(dict(sd), skeleton))
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
    default ``transformers.AutoModelForCausalLM`` (``transformers.AutoModel`` reads the body
    of a causal LM's folder without its head); ``dtype``: default the folder's
    (``config.json``), as transformers does; ``config_kwargs`` go to ``AutoConfig``. At
    stage 1 only rank 0 reads the folder ([Note: stage-1 load on rank 0] in
    engine/meta_init.py)."""
    import transformers

    auto_class = auto_class or transformers.AutoModelForCausalLM
    dtype_kw = {"dtype": dtype} if dtype is not None else {}
    on_meta = torch.empty(0).is_meta
    folder_path = Path(path)
    rank0_only = (not on_meta and values_come_from_rank0() and (folder_path / "config.json").is_file()
                  and any(folder_path.glob("*.safetensors")))  # the same decision on every rank
    if not on_meta and not rank0_only:
        return auto_class.from_pretrained(str(path), **dtype_kw, **config_kwargs)
    folder = PretrainedFolder(path)
    if rank0_only:  # stage 1, not rank 0: [Note: stage-1 load on rank 0] in engine/meta_init.py
        return _rank0_skeleton(folder, auto_class, dtype, config_kwargs)
    config = transformers.AutoConfig.from_pretrained(str(path), **config_kwargs)
    model = auto_class.from_config(config, **dtype_kw)
    _register(model, folder, folder.check(model))
    return model


def _rank0_skeleton(folder: PretrainedFolder, auto_class: Any, dtype: torch.dtype | None,
                    config_kwargs: dict[str, Any]) -> nn.Module:
    """What rank 0's ``auto_class.from_pretrained`` returns, on the meta device: the same
    dtype (transformers 5 keeps the folder's ``config.dtype``, 4.x loads fp32 unless told),
    eval mode and the folder's generation config; checked against the folder; every module
    marked for ``prepare_stage1``."""
    import transformers
    from packaging.version import Version

    config = transformers.AutoConfig.from_pretrained(str(folder.path), **config_kwargs)
    if dtype is None:
        dtype = (getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32) \
            if Version(transformers.__version__) >= Version("5") else torch.float32
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), torch.float32)
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=dtype)
    folder.check(model)  # bad input fails here as on rank 0
    if (folder.path / "generation_config.json").is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(str(folder.path))
    model.eval()
    for m in model.modules():  # every module: a part taken out (get_decoder()) stays marked
        setattr(m, RANK0_VALUES_ATTR, True)
    return model


def fill_from_file(module: nn.Module, file: str | Path) -> bool:
    """Give ``module``, built on the meta device, the tensors of one safetensors ``file``
    (its state-dict names) when the strategy materializes it, each rank reading its rows
    only; checked now as ``from_pretrained`` checks a folder. Returns False, doing nothing,
    when ``module`` is not on the meta device (the caller loads it for real)."""
    if not has_meta(module):
        return False
    file = Path(file)
    folder = PretrainedFolder(file.parent, files=[file.name])
    _register(module, folder, folder.check(module))
    return True


def copy_on_materialize(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)`` that starts equal to ``module`` after materialization too.
    Built on the meta device, a deep copy has no values to copy, and ``materialize`` would
    draw the copy's own (a second LoRA A, say): registered here, each of its tensors is
    filled from the original's shard instead (the two must be sharded alike, the original
    materialized first: registered before the copy in the model). Off the meta device it is
    ``copy.deepcopy``."""
    import copy

    twin = copy.deepcopy(module)
    if has_meta(module):
        for (_, original), (_, sub) in zip(module.named_modules(remove_duplicate=False),
                                           twin.named_modules(remove_duplicate=False), strict=True):
            _COPIES[sub] = original
    return twin


def _register(model: nn.Module, folder: PretrainedFolder, prefix: str) -> None:
    for name, sub in model.named_modules(remove_duplicate=False):
        _SOURCES.setdefault(sub, (folder, f"{prefix}{name}." if name else prefix))


class Loads:
    """What ``materialize`` fills from elsewhere than a random draw, for the modules under
    ``root``: those ``from_pretrained`` or ``fill_from_file`` registered (their folder and
    key prefix), and the copies ``copy_on_materialize`` made (their original module)."""

    def __init__(self, root: nn.Module) -> None:
        self.by_module: dict[int, tuple[PretrainedFolder, str]] = {}
        self.copies: dict[int, nn.Module] = {}
        self.done: set[int] = set()  # tensors filled already (a tied weight is reached twice)
        for m in root.modules():
            src = _SOURCES.get(m)
            if src is not None:
                self.by_module[id(m)] = src
            original = _COPIES.get(m)
            if original is not None:
                self.copies[id(m)] = original

    @staticmethod
    def _own(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [*m._parameters.items(), *m._buffers.items()]

    def close(self) -> None:
        """Every folder read has given this rank its rows: unmap its files."""
        for folder, _ in self.by_module.values():
            folder.close()

    def init_needed(self, m: nn.Module) -> bool:
        """Whether ``m`` needs its initialization: it is neither a copy nor from a folder, or
        some tensor of its own is neither in the files nor filled already (a rotary cache)."""
        if id(m) in self.copies:
            return False
        src = self.by_module.get(id(m))
        if src is None:
            return True
        folder, prefix = src
        return any(t is not None and id(t) not in self.done and prefix + n not in folder.shapes
                   for n, t in self._own(m))

    def fill(self, m: nn.Module) -> None:
        """Copy ``m``'s tensors that the files (or its original) hold into this rank's shards."""
        original = self.copies.get(id(m))
        if original is not None:
            _copy_from(m, original)
            return
        src = self.by_module.get(id(m))
        if src is None:
            return
        folder, prefix = src
        for name, t in self._own(m):
            key = prefix + name
            if t is None or id(t) in self.done or key not in folder.shapes:
                continue
            _fill(t, folder, key)
            self.done.add(id(t))


@torch.no_grad()
def _copy_from(m: nn.Module, original: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    theirs = dict(Loads._own(original))
    for name, t in Loads._own(m):
        src = theirs.get(name)
        if t is None or src is None:
            continue
        if src.is_meta:
            raise UsageError(f"copy_on_materialize: the copy's {type(m).__name__}.{name} was reached before its "
                             "original was materialized",
                             "register the original module in the model before its copy")
        mine = t.to_local() if isinstance(t, DTensor) else t
        src = src.to_local() if isinstance(src, DTensor) else src
        if mine.shape != src.shape:
            raise UsageError(f"copy_on_materialize: {type(m).__name__}.{name} is sharded as {tuple(mine.shape)} in "
                             f"the copy and {tuple(src.shape)} in the original",
                             "shard the copy exactly as its original (same wrapping, same mesh)")
        mine.copy_(src.dequantize() if hasattr(src, "dequantize") else src)


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
            local.copy_(folder.read(key, start, stop))
    else:
        t.copy_(folder.read(key, 0, t.shape[0] if t.dim() else 0))

"""Layer: engine. Frozen parameters stored as int8 or int4 (ZeRO++ ``quantize_frozen_weights``, DeepSpeed's
``zero_quantized_nontrainable_weights``; ``frozen_weight_bits`` picks 8 or 4): for LoRA and
RLHF, where most weights never change, each rank keeps its shard of a frozen weight as
integer codes plus one fp32 scale per block. int8 takes about half the bytes of a 16-bit
shard and a quarter of an fp32 one; int4 (two codes per byte) half of that again.

Layer: engine.

[Note: frozen weight storage]
A frozen weight W (R rows, C = numel / R elements per row) becomes a ``QuantizedWeight``
of ``bits`` 8 or 4: fp32 scales (R, ceil(C / B)), blocks of B consecutive elements *within
a row* (the last block of a row is shorter, as if zero-padded), and codes
- bits=8: int8 (R, C), one code per element;
- bits=4: uint8 (R, ceil(C / 2)), two codes per byte (element 2i in the low nibble, the
  kernels' packing: [Note: quantization conventions] in kernels/reference.py); when C is
  odd the last byte of a row holds a padding code 0 in its high nibble.
Blocks never straddle rows, so FSDP2's dim-0 sharding splits codes and scales at the
same row and each rank's shard is itself a valid ``QuantizedWeight``: the quantization is
done once, before ``fully_shard``, and never again.

FSDP2 sees the weight through its public tensor-subclass extension
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``):
- pre-all-gather hands FSDP2 the codes and the scales as they are (no requantizing);
  FSDP2 gathers both in one uint8 buffer, so qwZ's comm object sends them plainly;
- post-all-gather dequantizes the gathered rows into a dense tensor in the compute
  dtype; FSDP2 frees it after forward (and after backward) like any unsharded param.
Bytes per rank per gather, per row: C + 4 ceil(C / B) at 8 bits (about 0.51 of bf16 at
B = 256), ceil(C / 2) + 4 ceil(C / B) at 4 bits (about 0.26 of bf16).

What FSDP2 does not support for extension tensors, and what we do about it:
- uneven dim-0 shards (FSDP2 then needs the all-gather inputs padded to the shard's
  padded shape, which codes and scales of different widths cannot be): a weight whose
  rows do not divide by the shard count stays dense (``frozen_int8_candidates``);
- hpZ's secondary shard (``reshard_after_forward=<int>`` raises NotImplementedError):
  blocks holding a ``QuantizedWeight`` reshard fully after forward and gather the codes
  again in backward (``engine.fsdp.shard_module``), which the strategy logs once.

Every other operation on a ``QuantizedWeight`` (``state_dict`` reads, ``full_tensor()``,
``copy_`` from a loaded checkpoint, in-place initialization after meta-device init) goes
through ``__torch_dispatch__``: reads see the dequantized values, writes requantize. So
a checkpoint holds the dense weights the model actually computes with, and loading one
requantizes them to the same codes (scales within 1 ulp; tests/test_frozen.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from zeropp_strategy import kernels
from zeropp_strategy.engine.dtensor import local as _local

aten = torch.ops.aten

# Elements (padded) per chunk of ``dequantize_rows`` for rows ending in a partial block: the
# transient buffer's size (64 MiB in fp32, or one padded row where that is larger), not the tensor's.
_ROW_CHUNK_ELEMS = 1 << 24


def _row_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    rows = shape[0] if len(shape) else 1
    return rows, (math.prod(shape) // rows if rows else math.prod(shape[1:]))


def code_bytes_per_row(row_elems: int, bits: int) -> int:
    """Bytes of codes for a row of ``row_elems`` elements: one each at 8 bits, two per byte at 4."""
    return -(-row_elems * bits // 8)


def quantize_rows(x: torch.Tensor, block_elems: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, ...) float -> codes (R, code_bytes_per_row(C, bits)), int8 at 8 bits or packed
    uint8 at 4, and scales fp32 (R, ceil(C/B)); see [Note: frozen weight storage]. Uses the
    block kernels (Triton on CUDA) over rows zero-padded to a block multiple, so the result
    equals ``kernels.quantize`` of each padded row, cut to the row's bytes."""
    rows, cols = _row_shape(x.shape)
    nb = max(1, -(-cols // block_elems))
    width = code_bytes_per_row(cols, bits)
    if rows == 0:
        return torch.zeros(0, width, dtype=kernels.code_dtype(bits), device=x.device), torch.zeros(0, nb, device=x.device)
    x2 = x.reshape(rows, cols)
    if cols != nb * block_elems:
        x2 = nn.functional.pad(x2, (0, nb * block_elems - cols))
    codes, scales = kernels.quantize(x2, block_elems, bits)
    return codes.view(rows, -1)[:, :width].contiguous(), scales.view(rows, nb)


def dequantize_rows(
    codes: torch.Tensor, scales: torch.Tensor, block_elems: int, dtype: torch.dtype, *, bits: int = 8,
    row_elems: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``quantize_rows``: (R, C) in ``dtype``, or written into ``out`` (of R x C
    elements in ``dtype``, on the codes' device) and ``out`` returned. ``row_elems`` is C; by
    default every code byte holds whole elements (C = columns of ``codes`` at 8 bits, twice
    that at 4), so pass it for an odd C at 4 bits. Rows of whole blocks are dequantized in
    one call straight into the result; rows ending in a partial block go through a buffer of
    ``_ROW_CHUNK_ELEMS`` padded elements (or one padded row, when that is larger) at a time,
    so no transient copy of the whole tensor exists (a gathered int4 ``lm_head`` of 8B
    parameters is 2 GB in fp32)."""
    rows = codes.shape[0]
    cols = codes.shape[1] * 8 // bits if row_elems is None else row_elems
    nb = scales.shape[1]
    if out is not None and (out.dtype != dtype or out.device != codes.device or out.numel() != rows * cols):
        raise ValueError(f"out is {out.dtype}{tuple(out.shape)} on {out.device}; dequantize_rows writes {rows} x "
                         f"{cols} elements of {dtype} on {codes.device}. Fix: pass an out of that size, dtype and "
                         "device, or no out.")
    dense = torch.empty(rows, cols, dtype=dtype, device=codes.device) if out is None else out.view(rows, cols)
    padded_cols = nb * block_elems
    if rows == 0:
        pass
    elif padded_cols == cols and dense.is_contiguous():
        kernels.dequantize(codes.reshape(-1), scales.reshape(-1), block_elems, rows * cols, bits, out=dense.view(-1))
    else:
        full = padded_cols * bits // 8  # each row's bytes padded to whole blocks; what the padding decodes to is cut
        step = max(1, _ROW_CHUNK_ELEMS // padded_cols)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            part = codes[r0:r1]
            part = part if part.shape[1] == full else nn.functional.pad(part, (0, full - part.shape[1]))
            values = kernels.dequantize(part.reshape(-1), scales[r0:r1].reshape(-1), block_elems,
                                        (r1 - r0) * padded_cols, bits, dense.dtype)
            dense[r0:r1].copy_(values.view(r1 - r0, padded_cols)[:, :cols])
    return dense if out is None else out


class QuantizedWeight(torch.Tensor):
    """A frozen weight held as row-blocked int8 or packed int4 codes + fp32 scales ([Note:
    frozen weight storage]). Looks like a dense tensor of its original shape and dtype to
    every caller; FSDP2 gathers its codes and scales and dequantizes after the gather."""

    codes: torch.Tensor  # bits=8: int8 (R, C); bits=4: uint8 (R, ceil(C / 2)), two codes per byte
    scales: torch.Tensor  # fp32 (R, ceil(C / block_elems))
    block_elems: int
    bits: int

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, shape: torch.Size,
                dtype: torch.dtype, bits: int = 8):
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=codes.device, requires_grad=False
        )

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, block_elems: int, shape: torch.Size,
                 dtype: torch.dtype, bits: int = 8):
        self.codes, self.scales, self.block_elems, self.bits = codes, scales, block_elems, bits

    @classmethod
    def from_dense(cls, x: torch.Tensor, block_elems: int, bits: int = 8) -> QuantizedWeight:
        kernels.check_quant_args(block_elems, bits)
        if x.is_meta:  # quantized when initialized (see quantize_frozen)
            rows, cols = _row_shape(x.shape)
            codes = torch.empty(rows, code_bytes_per_row(cols, bits), dtype=kernels.code_dtype(bits), device="meta")
            scales = torch.empty(rows, max(1, -(-cols // block_elems)), device="meta")
        else:
            codes, scales = quantize_rows(x.detach(), block_elems, bits)
        return cls(codes, scales, block_elems, x.shape, x.dtype, bits)

    @property
    def row_elems(self) -> int:
        """C: elements per row of the codes (a flattening view keeps the rows of the codes)."""
        rows = self.codes.shape[0]
        return self.numel() // rows if rows else self.codes.shape[1] * 8 // self.bits

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_rows(self.codes, self.scales, self.block_elems, dtype or self.dtype, bits=self.bits,
                               row_elems=self.row_elems).view(self.shape)

    @property
    def storage_bytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * 4

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"QuantizedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
                f"block_elems={self.block_elems})")

    # torch.compile / FSDP2 tracing support
    def __tensor_flatten__(self):
        return ["codes", "scales"], (self.block_elems, self.shape, self.dtype, self.bits)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):  # noqa: ANN001, ANN205
        block_elems, _, dtype, bits = meta
        return QuantizedWeight(inner["codes"], inner["scales"], block_elems, outer_size, dtype, bits)

    def _like(self, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...] | None = None) -> QuantizedWeight:
        if shape is None:
            shape = (codes.shape[0], *self.shape[1:])
        return QuantizedWeight(codes, scales, self.block_elems, torch.Size(shape), self.dtype, self.bits)

    # -- FSDP2 all-gather extension --------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ANN001, ANN201
        # Already quantized: gather codes and scales as stored ([Note: frozen weight storage]).
        return (self.codes, self.scales), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):  # noqa: ANN001, ANN201
        codes, scales = all_gather_outputs  # (W*R, code bytes per row) int8/uint8, (W*R, nb) fp32
        kw = {"bits": self.bits, "row_elems": self.row_elems}
        if out is not None:
            # Refill the unsharded param FSDP2 keeps across gathers. Autograd saved it in
            # forward; this write restores the same values, so keep its version (as FSDP2
            # does for its own copy-out).
            with torch.autograd._unsafe_preserve_version_counter(out):
                dequantize_rows(codes, scales, self.block_elems, out.dtype, out=out, **kw)
            return None
        dense = dequantize_rows(codes, scales, self.block_elems, param_dtype, **kw)
        # FSDP2 frees (and later refills) what the second element names.
        return dense, (dense,)

    # -- dispatch ---------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, *args, **kwargs)
        # Generic path: anything else sees the dequantized values; an in-place op on a
        # QuantizedWeight writes back by requantizing (initialization, load_state_dict).
        self = args[0] if args else None
        mutates = isinstance(self, QuantizedWeight) and func._schema.arguments and func._schema.arguments[0].is_write
        dense_args = tree_map(lambda t: t.dequantize() if isinstance(t, QuantizedWeight) else t, args)
        dense_kwargs = tree_map(lambda t: t.dequantize() if isinstance(t, QuantizedWeight) else t, kwargs)
        result = func(*dense_args, **dense_kwargs)
        if mutates:
            self._assign(dense_args[0])
            return self
        return result

    def _assign(self, dense: torch.Tensor) -> None:
        codes, scales = quantize_rows(dense.reshape(self.codes.shape[0], -1), self.block_elems, self.bits)
        self.codes.copy_(codes)
        self.scales.copy_(scales)


#: The name from before int4 (``bits=8`` is the default): the same class.
Int8Weight = QuantizedWeight


def _dim0(dim: int, ndim: int, op: str) -> None:
    if dim % max(ndim, 1) != 0:
        raise NotImplementedError(f"QuantizedWeight supports {op} on dim 0 only (rows), got dim={dim}")


def _split(func, self: QuantizedWeight, split_size, dim: int = 0):  # noqa: ANN001, ANN202
    _dim0(dim, self.dim(), "split")
    codes = func(self.codes, split_size, 0)
    scales = func(self.scales, split_size, 0)
    return [self._like(c, s) for c, s in zip(codes, scales)]


def _slice(func, self: QuantizedWeight, dim: int = 0, start=None, end=None, step: int = 1):  # noqa: ANN001, ANN202
    _dim0(dim, self.dim(), "slice")
    return self._like(func(self.codes, 0, start, end, step), func(self.scales, 0, start, end, step))


def _view(func, self: QuantizedWeight, size, *rest):  # noqa: ANN001, ANN202
    # A reshape keeps the row structure (codes stay (R, C)); FSDP2 only flattens a shard
    # to keep a reference to it, and never indexes the flat view.
    size = list(size)
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = self.numel() // known if known else 0
    if math.prod(size) != self.numel():
        raise RuntimeError(f"QuantizedWeight: cannot view shape {tuple(self.shape)} as {tuple(size)}")
    return self._like(self.codes, self.scales, tuple(size))


def _alias(func, self: QuantizedWeight, *rest, **kwargs):  # noqa: ANN001, ANN202
    return self._like(self.codes, self.scales, tuple(self.shape))


def _new_zeros(func, self: QuantizedWeight, size, **kwargs):  # noqa: ANN001, ANN202
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or self.device
    if dtype is not None and dtype != self.dtype:
        return torch.zeros(size, dtype=dtype, device=device)
    rows, cols = _row_shape(tuple(size))
    if cols != self.row_elems:
        return torch.zeros(size, dtype=self.dtype, device=device)
    codes = torch.zeros(rows, code_bytes_per_row(cols, self.bits), dtype=self.codes.dtype, device=device)
    scales = torch.zeros(rows, self.scales.shape[1], dtype=torch.float32, device=device)
    return self._like(codes, scales, tuple(size))


def _empty_like(func, self: QuantizedWeight, **kwargs):  # noqa: ANN001, ANN202
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or self.device
    if dtype is not None and dtype != self.dtype:
        return torch.empty(self.shape, dtype=dtype, device=device)
    return self._like(torch.empty_like(self.codes, device=device), torch.empty_like(self.scales, device=device))


def _to_copy(func, self: QuantizedWeight, **kwargs):  # noqa: ANN001, ANN202
    dtype = kwargs.get("dtype")
    device = kwargs.get("device") or self.device
    if dtype is not None and dtype != self.dtype:  # a dtype cast leaves quantized storage
        return self.dequantize(dtype).to(device)
    pin = bool(kwargs.get("pin_memory"))
    codes, scales = self.codes.to(device), self.scales.to(device)
    if pin:
        codes, scales = codes.pin_memory(), scales.pin_memory()
    return self._like(codes, scales, tuple(self.shape))


def _copy_(func, self, src, non_blocking: bool = False):  # noqa: ANN001, ANN202
    if not isinstance(self, QuantizedWeight):  # dense <- QuantizedWeight
        return self.copy_(src.dequantize(self.dtype), non_blocking)
    same_layout = isinstance(src, QuantizedWeight) and (src.codes.shape, src.block_elems, src.bits) == (
        self.codes.shape, self.block_elems, self.bits)
    if same_layout:
        self.codes.copy_(src.codes, non_blocking)
        self.scales.copy_(src.scales, non_blocking)
        return self
    dense = src.dequantize() if isinstance(src, QuantizedWeight) else src
    # rounded to the weight's dtype first, as a dense tensor of that dtype would hold it: a
    # streamed load hands over the file's rows (fp32 files into a bf16 model, for one)
    self._assign(dense.to(device=self.device, dtype=self.dtype).expand(self.shape))
    return self


def _is_pinned(func, self: QuantizedWeight, *rest):  # noqa: ANN001, ANN202
    return self.codes.is_pinned()


_HANDLERS = {
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.reshape.default: _view,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.new_zeros.default: _new_zeros,
    aten.empty_like.default: _empty_like,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.is_pinned.default: _is_pinned,
}


def frozen_int8_candidates(
    module: nn.Module, *, shard_world_size: int, min_elems: int
) -> tuple[list[tuple[nn.Module, str, str, nn.Parameter]], list[str]]:
    """Frozen floating-point params that can be stored quantized (int8 or int4), as (owner,
    attribute, qualified name, param), and the names of frozen ones that must stay dense,
    with why (for the log).

    Eligible: requires_grad=False, outside any module marked ``zeropp_keep_dense``, floating
    point, at least 2-D (biases and norms are tiny and precision-sensitive), >= ``min_elems``
    elements, rows divisible by the shard count (FSDP2 cannot pad extension tensors; see
    [Note: frozen weight storage])."""
    chosen: list[tuple[nn.Module, str, str, nn.Parameter]] = []
    dense: list[str] = []
    seen: set[int] = set()
    # Modules that update their frozen weights in place (an EMA copy) opt out with
    # ``zeropp_keep_dense = True``: quantized storage would drop every update.
    for dense_root in [m for m in module.modules() if getattr(m, "zeropp_keep_dense", False)]:
        seen.update(id(p) for p in dense_root.parameters())
    picked: set[int] = set()
    for owner_name, owner in module.named_modules():
        for name, p in owner.named_parameters(recurse=False):
            full = f"{owner_name}.{name}" if owner_name else name
            if id(p) in picked:  # a tied weight's second owner (lm_head): the same quantized parameter, still tied
                chosen.append((owner, name, full, p))
                continue
            if id(p) in seen or p.requires_grad or not p.is_floating_point() or isinstance(p.data, QuantizedWeight):
                continue
            seen.add(id(p))
            if p.dim() < 2 or p.numel() < min_elems:
                continue
            if p.shape[0] % shard_world_size:
                dense.append(f"{full} ({p.shape[0]} rows do not divide by {shard_world_size} shards)")
                continue
            chosen.append((owner, name, full, p))
            picked.add(id(p))
    return chosen, dense


@torch.no_grad()
def quantize_frozen(
    module: nn.Module, *, shard_world_size: int, block_elems: int, min_elems: int, bits: int = 8
) -> tuple[list[str], list[str]]:
    """Replace eligible frozen parameters of ``module`` with ``QuantizedWeight`` parameters of
    ``bits`` (8 or 4), in place and before ``fully_shard``. Returns (quantized names, names
    kept dense + why).

    Meta-device parameters are converted too (their codes are meta tensors); they are
    initialized, and so quantized, when the strategy materializes the sharded model."""
    if bits not in (8, 4):  # 2-bit codes are for what crosses nodes with its rounding fed back
        raise ValueError(f"bits={bits} is not supported for frozen weights. Fix: use 8 or 4.")
    kernels.check_quant_args(block_elems, bits)  # before any parameter is replaced
    chosen, dense = frozen_int8_candidates(module, shard_world_size=shard_world_size, min_elems=min_elems)
    names = []
    replaced: dict[int, nn.Parameter] = {}
    for owner, name, full, p in chosen:
        new = replaced.get(id(p))
        if new is None:
            weight = QuantizedWeight.from_dense(p.data, block_elems, bits)
            new = replaced[id(p)] = nn.Parameter(weight, requires_grad=False)
        setattr(owner, name, new)
        names.append(full)
        if not getattr(owner, "_zeropp_dense_state_hook", False):
            owner.register_state_dict_post_hook(_dense_state_dict_hook)
            owner._zeropp_dense_state_hook = True
    return names, dense


def dense_value(value: torch.Tensor) -> torch.Tensor:
    """``value`` with a ``QuantizedWeight`` (local or inside a DTensor) replaced by its
    dequantized dense tensor of the same layout; anything else unchanged."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and isinstance(value._local_tensor, QuantizedWeight):
        return DTensor.from_local(
            value._local_tensor.dequantize(), value.device_mesh, value.placements,
            run_check=False, shape=value.shape, stride=value.stride(),
        )
    if isinstance(value, QuantizedWeight):
        return value.dequantize()
    return value


def _dense_state_dict_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    # Checkpoints hold the dense weights the model computes with, in the parameter's
    # dtype: portable to any strategy and to `zeropp consolidate`. Loading one back
    # requantizes through QuantizedWeight.copy_ ([Note: frozen weight storage]).
    for name, p in module.named_parameters(recurse=False):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = dense_value(state_dict[key])


def int8_weights(params: Iterable[torch.Tensor]) -> list[QuantizedWeight]:
    """The ``QuantizedWeight`` local tensors (int8 or int4) among ``params`` (DTensor shards
    unwrapped)."""
    out = []
    for p in params:
        local = _local(p)
        local = local.data if isinstance(local, nn.Parameter) else local
        if isinstance(local, QuantizedWeight):
            out.append(local)
    return out

"""``quantize_frozen_weights``: frozen shards stored as int8 or int4 (engine/frozen.py).

Unit checks of ``QuantizedWeight`` (``Int8Weight``) in one process, then one 2-rank spawn
per code width (``frozen_weight_bits`` 8 and 4) that trains a frozen-base model with
hand-made LoRA adapters at stage 3 and compares it with DDP on the same model whose
frozen weights were quantized and dequantized up front (the weights stage 3 computes
with): the adapters must train to the same values.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from zeropp_strategy import kernels
from zeropp_strategy.engine.frozen import (
    Int8Weight,
    QuantizedWeight,
    code_bytes_per_row,
    dequantize_rows,
    frozen_int8_candidates,
    quantize_frozen,
    quantize_rows,
)

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

B = 32  # block size of the distributed scenarios (rows of 32 and 64 elements)


# -- one process ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 100), (5, 3, 7), (64, 32), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_quantize_like_padded_flat_blocks(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    codes, scales = quantize_rows(x, B)
    rows, cols = shape[0], x.numel() // shape[0]
    nb = -(-cols // B)
    assert codes.shape == (rows, cols) and codes.dtype == torch.int8
    assert scales.shape == (rows, nb) and scales.dtype == torch.float32
    # Each row quantizes exactly as the flat kernel does on that row zero-padded.
    for r in range(rows):
        padded = torch.nn.functional.pad(x.reshape(rows, cols)[r].float(), (0, nb * B - cols))
        c_ref, s_ref = kernels.quantize(padded, B, 8)
        assert torch.equal(codes[r], c_ref[:cols]) and torch.equal(scales[r], s_ref)
    # Error bound: half a step of the row-block, plus the output dtype's rounding.
    back = dequantize_rows(codes, scales, B, torch.float32)
    step = scales.repeat_interleave(B, dim=1)[:, :cols]
    eps = torch.finfo(dtype).eps * x.float().abs().reshape(rows, cols)
    assert ((back - x.float().reshape(rows, cols)).abs() <= step / 2 + eps + 1e-7).all()


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("cols", (2 * B, 2 * B - 3))  # rows of whole blocks; rows ending in a partial block
def test_dequantize_rows_into_out_holds_no_copy_of_the_whole(monkeypatch, bits, cols):
    """Into ``out`` (FSDP2's kept unsharded weight, refilled at every gather after the first) the
    values are those of a fresh dequantize, and no buffer of the whole tensor's size is made
    beside ``out``: rows of whole blocks are dequantized straight into it, others in chunks."""
    import zeropp_strategy.engine.frozen as frozen

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, cols, generator=g)
    codes, scales = quantize_rows(x, B, bits)
    want = dequantize_rows(codes, scales, B, torch.float32, bits=bits, row_elems=cols)
    made: list[int] = []  # elements of each buffer kernels.dequantize allocates
    real = kernels.dequantize

    def spy(*args, out=None, **kwargs):
        result = real(*args, out=out, **kwargs)
        if out is None:
            made.append(result.numel())
        return result

    monkeypatch.setattr(frozen.kernels, "dequantize", spy)
    monkeypatch.setattr(frozen, "_ROW_CHUNK_ELEMS", 8 * 2 * B)  # 8 padded rows per chunk
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((40, cols), float("nan"), dtype=dtype)
        made.clear()
        assert dequantize_rows(codes, scales, B, dtype, bits=bits, row_elems=cols, out=out) is out
        assert torch.equal(out, want.to(dtype)), dtype
        assert made == ([] if cols == 2 * B else [8 * 2 * B] * 5), made
    with pytest.raises(ValueError, match="out is torch.float16.*Fix:"):  # another dtype than asked: refused
        dequantize_rows(codes, scales, B, torch.float32, bits=bits, row_elems=cols,
                        out=torch.empty(40, cols, dtype=torch.float16))
    made.clear()  # and without out: the result is the one buffer
    assert torch.equal(dequantize_rows(codes, scales, B, torch.float32, bits=bits, row_elems=cols), want)
    assert made == ([] if cols == 2 * B else [8 * 2 * B] * 5), made


@pytest.mark.parametrize("bits", (8, 4))
def test_copy_into_a_quantized_weight_rounds_to_its_dtype_first(bits):
    """A write of more precise values (fp32 rows of a file into a bf16 model, as the streamed
    load hands them over) quantizes what a dense tensor of the weight's dtype would hold."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=g)
    w = QuantizedWeight.from_dense(torch.zeros(4, 256, dtype=torch.bfloat16), B, bits)
    w.copy_(x)
    want = QuantizedWeight.from_dense(x.to(torch.bfloat16), B, bits)
    assert torch.equal(w.codes, want.codes) and torch.equal(w.scales, want.scales)


def test_int8_weight_halves_16bit_storage():
    x = torch.randn(512, 1024, dtype=torch.bfloat16)
    w = Int8Weight.from_dense(x, 256)
    ratio = w.storage_bytes / (x.numel() * x.element_size())
    assert 0.50 <= ratio <= 0.51, ratio  # 1 byte + 4/256 per element vs 2
    assert Int8Weight.from_dense(x.float(), 256).storage_bytes / (x.numel() * 4) <= 0.26


def test_int8_weight_behaves_like_its_dense_values():
    x = torch.randn(8, 40)
    w = Int8Weight.from_dense(x, B)
    dense = w.dequantize()
    assert w.shape == x.shape and w.dtype == x.dtype and not w.requires_grad
    # Row ops stay int8 and share storage; anything else sees the dequantized values.
    parts = torch.chunk(w, 4, dim=0)
    assert all(isinstance(p, Int8Weight) for p in parts)
    assert parts[1].codes.data_ptr() == w.codes[2:].data_ptr()
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), dense)
    assert torch.equal(w.narrow(0, 3, 2).dequantize(), dense[3:5])
    flat = w.view(-1)
    assert isinstance(flat, Int8Weight) and flat.shape == (320,) and flat.codes.data_ptr() == w.codes.data_ptr()
    assert torch.equal(w @ torch.eye(40), dense)  # generic path
    assert torch.equal(w.to(torch.float64), dense.double()) and type(w.to(torch.float64)) is torch.Tensor
    assert torch.equal(w.clone(), dense)
    with pytest.raises(NotImplementedError, match="dim 0"):
        torch.chunk(w, 2, dim=1)


def test_writes_requantize_and_reloading_keeps_codes():
    x = torch.randn(8, 40)
    w = Int8Weight.from_dense(x, B)
    codes, scales = w.codes.clone(), w.scales.clone()
    # Loading the dequantized weights back (what a checkpoint holds) gives the same codes,
    # scales within 1 ulp (absmax = 127 * scale is recomputed in fp32).
    w.copy_(w.dequantize())
    assert torch.equal(w.codes, codes)
    assert ((w.scales - scales).abs() <= torch.finfo(torch.float32).eps * scales.abs()).all()
    # In-place writes (initialization after meta-device init, load_state_dict) requantize.
    y = torch.randn(8, 40)
    w.copy_(y)
    assert torch.equal(w.codes, quantize_rows(y, B)[0])
    w.fill_(0.5)
    assert torch.allclose(w.dequantize(), torch.full((8, 40), 0.5))
    w.zero_()
    assert not w.codes.any() and not w.scales.any()
    # An Int8Weight copies into a dense tensor as its values.
    out = torch.empty(8, 40)
    out.copy_(Int8Weight.from_dense(y, B))
    assert torch.equal(out, dequantize_rows(*quantize_rows(y, B), B, torch.float32))


def test_candidates_skip_trainable_small_and_uneven():
    from torch import nn

    m = nn.ModuleDict({"a": nn.Linear(8, 6), "b": nn.Linear(8, 5), "c": nn.Linear(8, 4), "d": nn.Linear(2, 2)})
    m.requires_grad_(False)
    m["c"].requires_grad_(True)
    chosen, dense = frozen_int8_candidates(m, shard_world_size=2, min_elems=10)
    assert [full for _, _, full, _ in chosen] == ["a.weight"]  # d is below min_elems; biases are 1-D
    assert dense == ["b.weight (5 rows do not divide by 2 shards)"]
    names, _ = quantize_frozen(m, shard_world_size=2, block_elems=B, min_elems=10)
    assert names == ["a.weight"] and isinstance(m["a"].weight.data, Int8Weight)
    # state_dict shows dense values: checkpoints stay portable.
    sd = m.state_dict()
    assert type(sd["a.weight"]) is torch.Tensor and torch.equal(sd["a.weight"], m["a"].weight.data.dequantize())


def test_a_tied_weight_stays_tied_when_quantized():
    """An embedding tied to the output layer (lm_head) is one quantized parameter in both
    places: quantizing only the first owner would leave the second computing with the old
    dense weight, and an export could then hold only one of the two."""
    from torch import nn

    m = nn.ModuleDict({"embed": nn.Embedding(8, 16), "head": nn.Linear(16, 8, bias=False)})
    m["head"].weight = m["embed"].weight
    m.requires_grad_(False)
    names, _ = quantize_frozen(m, shard_world_size=2, block_elems=B, min_elems=0)
    assert names == ["embed.weight", "head.weight"]
    assert m["head"].weight is m["embed"].weight and isinstance(m["embed"].weight.data, Int8Weight)


def test_meta_parameters_stay_meta_until_initialized():
    from torch import nn

    with torch.device("meta"):
        m = nn.Linear(32, 64).requires_grad_(False)
    quantize_frozen(m, shard_world_size=1, block_elems=B, min_elems=0)
    w = m.weight.data
    assert isinstance(w, Int8Weight) and w.codes.is_meta
    m.to_empty(device="cpu")
    m.reset_parameters()
    w = m.weight.data
    assert isinstance(w, Int8Weight) and not w.codes.is_meta and w.scales.abs().sum() > 0


# -- 2 ranks ---------------------------------------------------------------------------------


def _full_state(trainer, module):
    from zeropp_strategy.engine.state import to_full_cpu

    sd = module.state_dict()
    if hasattr(trainer.strategy, "config") and trainer.strategy.stage in (2, 3):
        return to_full_cpu(sd, keep=True)
    return {k: v.detach().clone() for k, v in sd.items()}


def _worker(rank, world, tmp, bits=8):
    import os

    from lightning.pytorch import Callback, Trainer, seed_everything

    from tests._models import FrozenBaseModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    class Reference(FrozenBaseModule):
        """The same model with its frozen >= 2-D weights quantized and dequantized."""

        def configure_model(self) -> None:
            if self.net is not None:
                return
            super().configure_model()
            with torch.no_grad():
                for p in self.net.parameters():
                    if not p.requires_grad and p.dim() >= 2:
                        p.copy_(dequantize_rows(*quantize_rows(p, B, bits), B, p.dtype, bits=bits).view_as(p))

    def strategy(**kw):
        return ZeroPPStrategy(stage=3, quantize_frozen_weights=True, frozen_weight_bits=bits,
                              weight_quant_block_elems=B, quantize_min_elems=0, **kw)

    out = {}
    seed_everything(0)
    ref_module = Reference()
    t = Trainer(strategy="ddp", **trainer_kwargs(world, max_steps=8))
    t.fit(ref_module)
    ref = _full_state(t, ref_module)

    seed_everything(0)
    m = FrozenBaseModule()
    t = Trainer(strategy=strategy(), **trainer_kwargs(world, max_steps=8))
    t.fit(m)
    got = _full_state(t, m)
    locals_ = {n: p.to_local() for n, p in m.named_parameters()}
    int8 = {n: q for n, q in locals_.items() if isinstance(q, Int8Weight)}
    stats = t.strategy.memory_stats()
    out["parity"] = {
        "keys": sorted(got) == sorted(ref),
        "max_diff": max((got[k].float() - ref[k].float()).abs().max().item() for k in ref),
        "int8": sorted(int8),
        "storage_ok": all(
            q.storage_bytes
            == (p.shape[0] // world) * (code_bytes_per_row(p[0].numel(), bits) + 4 * -(-p[0].numel() // B))
            for n, q in int8.items() for p in [dict(m.named_parameters())[n]]
        ),
        "layout": sorted({(q.bits, str(q.codes.dtype)) for q in int8.values()}),
        # per rank: half a byte per element at 4 bits (every row here has an even C) + 4 bytes per block
        "rank_bytes": (sum(q.storage_bytes for q in int8.values()),
                       sum(q.numel() * bits // 8 + 4 * q.scales.numel() for q in int8.values())),
        "memory_formula": (stats.param_bytes, stats.predicted_param_bytes),
    }

    # Sharded checkpoint: resuming restores the same codes (scales within 1 ulp).
    path = os.path.join(tmp, "sharded.ckpt")
    t.save_checkpoint(path)
    seed_everything(0)
    m2 = FrozenBaseModule()
    t2 = Trainer(strategy=strategy(), **trainer_kwargs(world, max_steps=8))
    t2.fit(m2, ckpt_path=path)
    codes_equal, scale_ulps, dense_equal = True, 0.0, True
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        a, b = p.to_local(), p2.to_local()
        if isinstance(a, Int8Weight):
            codes_equal &= isinstance(b, Int8Weight) and torch.equal(a.codes, b.codes)
            ulp = torch.finfo(torch.float32).eps * a.scales.abs().clamp_min(1e-30)
            scale_ulps = max(scale_ulps, ((a.scales - b.scales).abs() / ulp).max().item())
        else:
            dense_equal &= torch.equal(a, b)
    out["resume"] = {"codes_equal": codes_equal, "scale_ulps": scale_ulps, "dense_equal": dense_equal}

    # Full checkpoint: plain dense tensors, as DDP would save them.
    full_path = os.path.join(tmp, "full.ckpt")
    t3 = Trainer(strategy=strategy(state_dict_type="full"), **trainer_kwargs(world, max_steps=8))
    seed_everything(0)
    m3 = FrozenBaseModule()
    t3.fit(m3)
    t3.save_checkpoint(full_path)
    t3.strategy.barrier()
    if rank == 0:
        saved = torch.load(full_path, weights_only=True)["state_dict"]
        out["full"] = {
            "plain": all(type(v) is torch.Tensor for v in saved.values()),
            "max_diff": max((saved[k].float() - ref[k].float()).abs().max().item() for k in ref),
        }
    # ... and loading it requantizes into the int8 shards: same codes as the run that saved.
    seed_everything(0)
    m5 = FrozenBaseModule(seed=8)  # a different init: nothing matches unless the load wrote it
    t5 = Trainer(strategy=strategy(state_dict_type="full"), **trainer_kwargs(world, max_steps=8))
    t5.fit(m5, ckpt_path=full_path)
    out["full_resume_codes_equal"] = all(
        torch.equal(a.to_local().codes, b.to_local().codes) if isinstance(a.to_local(), Int8Weight)
        else torch.equal(a.to_local(), b.to_local())
        for a, b in zip(m3.parameters(), m5.parameters())
    )

    # Meta-device init: frozen weights are quantized when their shards are initialized.
    seed_everything(0)
    m4 = FrozenBaseModule(meta_init=True)
    t4 = Trainer(strategy=strategy(), **trainer_kwargs(world, max_steps=4))
    t4.fit(m4)
    out["meta"] = {
        "int8": sum(isinstance(p.to_local(), Int8Weight) for p in m4.parameters()),
        "finite": bool(torch.isfinite(t4.callback_metrics["train_loss"])),
        "no_meta": not any(p.to_local().is_meta for p in m4.parameters()),
    }

    # The frozen embedding as a group of its own ([Note: frozen leaves]), in a module shaped
    # like a Hugging Face model (its input/output embeddings, untied): blocks named, every
    # size worth a group. It is gathered for its forward only: by the head's forward (root
    # group, gathered) it is a shard again, and backward gathers the two blocks only. The
    # same module without the Hugging Face shape keeps it in the root. Training equals the
    # same DDP reference either way.
    from types import SimpleNamespace

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from zeropp_strategy import CommKind
    from zeropp_strategy.engine.fsdp import model_shape

    class HFShaped(FrozenBaseModule):
        config = SimpleNamespace(tie_word_embeddings=False)

        def get_input_embeddings(self):
            return self.net["embed"]

        def get_output_embeddings(self):
            return self.net["head"]  # trainable: stays in the root's group

    out["leaf"] = {}
    for name, cls in (("hf", HFShaped), ("plain", FrozenBaseModule)):
        seed_everything(0)
        m6 = cls()
        t6 = Trainer(strategy=strategy(wrap_modules=["LoraBlock"], wrap_min_params=1),
                     **trainer_kwargs(world, max_steps=8))
        embed_sharded_at_head: list[bool] = []

        class Watch(Callback):
            def on_fit_start(self, trainer, module):
                module.net["head"].register_forward_pre_hook(
                    lambda mod, args: embed_sharded_at_head.append(isinstance(module.net["embed"].weight, DTensor)))

        t6.callbacks.append(Watch())
        t6.fit(m6)
        got6 = _full_state(t6, m6)
        out["leaf"][name] = {
            "groups": sorted(n for n, mod in m6.named_modules() if isinstance(mod, FSDPModule)),
            "embed_sharded_at_head": embed_sharded_at_head,
            "backward_gathers": t6.strategy.comm_ledger.totals(CommKind.PARAM_ALLGATHER_BWD).calls,
            "max_diff": max((got6[k].float() - ref[k].float()).abs().max().item() for k in ref),
            "shape": model_shape(m6, wrap_modules=("LoraBlock",), wrap_min_params=1),
            "embed_numel": m6.net["embed"].weight.numel(),  # a DTensor's numel is the whole tensor's
        }

    # An odd row (21 elements: not a multiple of the block, nor of 2) through FSDP2's gather.
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    odd = nn.Linear(21, 6, bias=False).requires_grad_(False)
    expect = dequantize_rows(*quantize_rows(odd.weight, B, bits), B, torch.float32, bits=bits, row_elems=21)
    quantize_frozen(odd, shard_world_size=world, block_elems=B, min_elems=0, bits=bits)
    fully_shard(odd, mesh=init_device_mesh("cpu", (world,)))
    x = torch.randn(4, 21)
    shard = odd.weight.to_local()
    out["odd"] = {
        "codes_shape": tuple(shard.codes.shape),
        "storage_bytes": shard.storage_bytes,
        "full_equal": torch.equal(odd.weight.full_tensor(), expect),
        "forward_diff": (odd(x) - x @ expect.T).abs().max().item(),  # the root keeps its gathered weight
    }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(_worker, 2, (str(tmp_path_factory.mktemp("frozen")),), timeout_s=300)


def test_stage3_with_int8_frozen_trains_like_ddp_on_the_dequantized_model(runs):
    for r in runs:
        p = r["parity"]
        assert p["keys"]
        assert p["max_diff"] <= 1e-6, p["max_diff"]  # adapters, head and the frozen weights
        assert p["int8"] == ["net.blocks.0.down.weight", "net.blocks.0.up.weight", "net.blocks.1.down.weight",
                             "net.blocks.1.up.weight", "net.embed.weight"]


def test_int8_frozen_storage_and_memory_formula(runs):
    for r in runs:
        assert r["parity"]["storage_ok"]
        held, predicted = r["parity"]["memory_formula"]
        assert held == predicted, (held, predicted)


def test_checkpoints_restore_the_same_codes(runs):
    for r in runs:
        res = r["resume"]
        assert res["codes_equal"] and res["dense_equal"]
        assert res["scale_ulps"] <= 1.0, res
    full = runs[0]["full"]
    assert full["plain"] and full["max_diff"] <= 1e-6, full
    assert all(r["full_resume_codes_equal"] for r in runs)


def test_a_frozen_embedding_is_a_group_gathered_for_its_forward_only(runs, runs_int4):
    """At stage 3 a Hugging Face model's frozen, untied input embedding is a group of its own
    ([Note: frozen leaves] in engine/wrap.py): a shard again before the head computes, not
    gathered in backward (8 steps x the 2 blocks), while the trainable head stays in the
    root's group. Without the Hugging Face shape it stays in the root. Both equal the DDP
    reference."""
    for r in (*runs, *runs_int4):
        hf, plain = r["leaf"]["hf"], r["leaf"]["plain"]
        assert hf["groups"] == ["net.blocks.0", "net.blocks.1", "net.embed"], hf["groups"]
        assert hf["embed_sharded_at_head"] and all(hf["embed_sharded_at_head"]), hf
        assert hf["backward_gathers"] == 8 * 2, hf["backward_gathers"]
        assert plain["groups"] == ["net.blocks.0", "net.blocks.1"], plain["groups"]
        assert plain["embed_sharded_at_head"] and not any(plain["embed_sharded_at_head"]), plain
        assert plain["backward_gathers"] == 8 * 2, plain["backward_gathers"]
        for leaf in (hf, plain):
            assert leaf["max_diff"] <= 1e-6, leaf["max_diff"]
        # the plan prices the leaf as a leaf: gathered for its forward only (an embedding)
        n = hf["embed_numel"]
        assert (hf["shape"].largest_leaf, hf["shape"].leaf_params, hf["shape"].leaf_backward) == (n, n, 0)
        assert (plain["shape"].largest_leaf, plain["shape"].leaf_params, plain["shape"].leaf_backward) == (0, 0, 0)


def test_meta_init_quantizes_after_materializing(runs):
    for r in runs:
        assert r["meta"] == {"int8": 5, "finite": True, "no_meta": True}


# -- int4 (frozen_weight_bits=4) -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 100), (5, 3, 7), (64, 32), (1, 1), (4, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_rows_pack_two_codes_per_byte_within_the_bound(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    codes, scales = quantize_rows(x, B, 4)
    rows, cols = shape[0], x.numel() // shape[0]
    nb = -(-cols // B)
    assert codes.shape == (rows, -(-cols // 2)) and codes.dtype == torch.uint8
    assert scales.shape == (rows, nb) and scales.dtype == torch.float32
    for r in range(rows):  # each row: the flat int4 kernel on the zero-padded row, cut to its bytes
        padded = torch.nn.functional.pad(x.reshape(rows, cols)[r].float(), (0, nb * B - cols))
        c_ref, s_ref = kernels.quantize(padded, B, 4)
        assert torch.equal(codes[r], c_ref[: -(-cols // 2)]) and torch.equal(scales[r], s_ref)
    # Error bound: half a step, absmax(block) / 14, plus the output dtype's rounding.
    back = dequantize_rows(codes, scales, B, torch.float32, bits=4, row_elems=cols)
    dense = x.float().reshape(rows, cols)
    absmax = dense.abs().reshape(rows, -1)
    step = scales.repeat_interleave(B, dim=1)[:, :cols]
    assert torch.allclose(step * 7, torch.nn.functional.pad(absmax, (0, nb * B - cols)).view(rows, nb, B)
                          .amax(-1).repeat_interleave(B, dim=1)[:, :cols])
    assert ((back - dense).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(QuantizedWeight.from_dense(x, B, 4).dequantize(torch.float32), back.view(shape))


@pytest.mark.parametrize("shape", [(512, 1024), (6, 100), (4, 33), (5, 3, 7)])
def test_int4_storage_bytes_exact(shape):
    x = torch.randn(shape, dtype=torch.bfloat16)
    rows, cols = shape[0], x.numel() // shape[0]
    w4 = QuantizedWeight.from_dense(x, 256, 4)
    w8 = QuantizedWeight.from_dense(x, 256, 8)
    blocks = rows * -(-cols // 256)
    assert w4.storage_bytes == rows * -(-cols // 2) + 4 * blocks  # ceil(C/2) code bytes per row + fp32 scales
    assert w8.storage_bytes == rows * cols + 4 * blocks
    if shape == (512, 1024):  # even rows: numel / 2 exactly; 0.5 + 4/256 bytes per element vs bf16's 2
        assert w4.storage_bytes == x.numel() // 2 + 4 * x.numel() // 256
        assert 0.25 <= w4.storage_bytes / (x.numel() * 2) <= 0.26


def test_int4_weight_behaves_like_its_dense_values():
    x = torch.randn(8, 41)  # odd rows of codes: the last byte of each row holds one code
    w = QuantizedWeight.from_dense(x, B, 4)
    dense = w.dequantize()
    assert repr(w) == "QuantizedWeight(shape=(8, 41), dtype=torch.float32, bits=4, block_elems=32)"
    assert Int8Weight is QuantizedWeight and w.shape == x.shape and not w.requires_grad
    parts = torch.chunk(w, 4, dim=0)
    assert all(isinstance(p, QuantizedWeight) and p.bits == 4 for p in parts)
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), dense)
    flat = w.view(-1)
    assert flat.shape == (328,) and torch.equal(flat.dequantize(), dense.view(-1))
    assert torch.equal(w @ torch.eye(41), dense) and torch.equal(w.clone(), dense)
    like = torch.empty_like(w)
    assert isinstance(like, QuantizedWeight) and like.bits == 4 and like.codes.shape == (8, 21)
    zeros = w.new_zeros((8, 41))
    assert isinstance(zeros, QuantizedWeight) and zeros.bits == 4 and not zeros.dequantize().any()


def test_int4_writes_requantize_and_reloading_keeps_codes():
    x = torch.randn(8, 41)
    w = QuantizedWeight.from_dense(x, B, 4)
    codes, scales = w.codes.clone(), w.scales.clone()
    w.copy_(w.dequantize())  # what a checkpoint holds, loaded back
    assert torch.equal(w.codes, codes)
    assert ((w.scales - scales).abs() <= torch.finfo(torch.float32).eps * scales.abs()).all()
    y = torch.randn(8, 41)
    w.copy_(y)
    assert torch.equal(w.codes, quantize_rows(y, B, 4)[0])
    w8 = QuantizedWeight.from_dense(y, B, 8)
    w.copy_(w8)  # a different width: through the dense values
    assert torch.equal(w.codes, quantize_rows(w8.dequantize(), B, 4)[0])


def test_bad_bits_raise_before_any_replacement():
    from torch import nn

    m = nn.Linear(32, 64).requires_grad_(False)
    with pytest.raises(ValueError, match=r"bits=3 .*Fix: use 8 or 4"):
        quantize_frozen(m, shard_world_size=1, block_elems=B, min_elems=0, bits=3)
    assert type(m.weight.data) is torch.Tensor
    with torch.device("meta"):
        meta = nn.Linear(32, 64).requires_grad_(False)
    names, _ = quantize_frozen(meta, shard_world_size=1, block_elems=B, min_elems=0, bits=4)
    assert names == ["weight"] and meta.weight.data.codes.shape == (64, 16) and meta.weight.data.codes.is_meta


@pytest.fixture(scope="module")
def runs_int4(tmp_path_factory):
    return run_ranks(_worker, 2, (str(tmp_path_factory.mktemp("frozen4")), 4), timeout_s=300)


def test_stage3_with_int4_frozen_trains_like_ddp_on_the_dequantized_model(runs_int4):
    for r in runs_int4:
        p = r["parity"]
        assert p["keys"] and p["layout"] == [(4, "torch.uint8")]
        assert p["max_diff"] <= 1e-6, p["max_diff"]
        assert p["int8"] == ["net.blocks.0.down.weight", "net.blocks.0.up.weight", "net.blocks.1.down.weight",
                             "net.blocks.1.up.weight", "net.embed.weight"]


def test_int4_frozen_storage_bytes_and_memory_formula(runs_int4, runs):
    for r4, r8 in zip(runs_int4, runs):
        assert r4["parity"]["storage_ok"]
        held, expected = r4["parity"]["rank_bytes"]
        assert held == expected, (held, expected)
        assert r4["parity"]["memory_formula"][0] == r4["parity"]["memory_formula"][1]
        assert r4["parity"]["memory_formula"][0] < r8["parity"]["memory_formula"][0]


def test_int4_checkpoints_restore_the_same_codes(runs_int4):
    for r in runs_int4:
        res = r["resume"]
        assert res["codes_equal"] and res["dense_equal"] and res["scale_ulps"] <= 1.0, res
        assert r["full_resume_codes_equal"]
    full = runs_int4[0]["full"]
    assert full["plain"] and full["max_diff"] <= 1e-6, full
    for r in runs_int4:
        assert r["meta"] == {"int8": 5, "finite": True, "no_meta": True}


def test_odd_rows_gather_through_fsdp2(runs_int4, runs):
    for r, bits in [(r, 4) for r in runs_int4] + [(r, 8) for r in runs]:
        odd = r["odd"]
        assert odd["codes_shape"] == (3, 11 if bits == 4 else 21)  # 6 rows over 2 ranks
        assert odd["storage_bytes"] == 3 * (odd["codes_shape"][1] + 4)
        assert odd["full_equal"] and odd["forward_diff"] <= 1e-6, odd

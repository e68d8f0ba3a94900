"""Sharded checkpoints that stream: neither a save nor a resume holds a rank's whole shard.

- Save: DCP's writer clones every tensor whose storage is larger than the tensor, and
  torch 2.13's writer keeps each tensor it wrote until the rank's file is finished
  (pytorch/pytorch#195982), so an FSDP2 shard or an NVMe swap-file view was copied whole.
  ``save_tensors`` hands DCP zero-copy views with storages of their own size instead.
  Reference: the source tensors' memory (the writer must see it, not a copy) and the
  values read back.
- Resume: with the optimizer state on NVMe, the state is read straight into the swap
  files (``OffloadOptimizer.checkpoint_target``), never into fresh tensors. Reference:
  the same optimizer resumed from a host state dict, trained on, bit for bit.

The 2-rank Lightning resumes of every offload mode are in tests/test_offload.py
(``test_checkpoints_resume_bit_exact_with_offload``); the measurement at 2B parameters
is ``benchmarks/infinity.py --checkpoint`` (docs/offload.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs

from tests.test_offload import _config, _max_diff, _net, _train
from zeropp_strategy.checkpoint import sharded
from zeropp_strategy.offload import OffloadOptimizer


def _seen_by_writer(monkeypatch) -> list[torch.Tensor]:
    """Every tensor DCP's file writer serializes, as it gets it."""
    seen: list[torch.Tensor] = []
    values = dcp_fs._SerialCpuLoader.values

    def spy(self):
        for tensor, item in values(self):
            seen.append(tensor)
            yield tensor, item

    monkeypatch.setattr(dcp_fs._SerialCpuLoader, "values", spy)
    return seen


def _single_process(fn, *args, **kwargs):
    with warnings.catch_warnings():  # DCP says it assumes one process when no group exists
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def test_the_writer_gets_views_of_the_tensors_not_copies(tmp_path, monkeypatch):
    base = torch.arange(4096, dtype=torch.float32)
    tensors = {
        "model": {"row": base[100:400].view(30, 10), "whole": torch.randn(7), "tail": base[4000:]},
        "optim": {"0": {"w": {"exp_avg": base[1000:1300], "step": torch.tensor(3.0)}}},
    }
    sources = [tensors["model"]["row"], tensors["model"]["whole"], tensors["model"]["tail"],
               tensors["optim"]["0"]["w"]["exp_avg"]]
    seen = _seen_by_writer(monkeypatch)
    _single_process(sharded.save_tensors, tensors, tmp_path / "ck")
    written = {t.data_ptr() for t in seen}
    for src in sources:  # each source's own memory went to the writer
        assert src.data_ptr() in written
    back = {"model": {k: torch.zeros_like(v) for k, v in tensors["model"].items()},
            "optim": {"0": {"w": {"exp_avg": torch.zeros(300), "step": torch.tensor(0.0)}}}}
    _single_process(dcp.load, back, checkpoint_id=str(tmp_path / "ck"))
    for key, v in tensors["model"].items():
        assert torch.equal(back["model"][key], v), key
    assert torch.equal(back["optim"]["0"]["w"]["exp_avg"], base[1000:1300])
    assert back["optim"]["0"]["w"]["step"].item() == 3.0


def test_own_storage_views_keep_their_memory_alive():
    view = sharded._own_storage(torch.arange(10.0)[2:])  # the base tensor is gone at once
    torch.zeros(100_000)  # memory the freed base would be reused for
    assert view.untyped_storage().nbytes() == view.nbytes
    assert view.tolist() == [float(i) for i in range(2, 10)]


def test_nvme_optimizer_state_resumes_in_place_into_the_swap_files(tmp_path, monkeypatch):
    cls, kw = torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)
    a = _net()
    oa = OffloadOptimizer(cls(a.parameters(), **kw), _config("nvme", tmp_path))
    _train(a, oa, 3)
    tensors, meta = sharded.optimizer_tensors_and_meta(a, oa)
    seen = _seen_by_writer(monkeypatch)
    _single_process(sharded.save_tensors, {"model": sharded.model_tensors(a), "optim": {"0": tensors}}, tmp_path / "ck")
    assert seen  # the state went through DCP
    b = _net()
    _single_process(sharded.load_model, b, tmp_path / "ck", strict=True)
    ob = OffloadOptimizer(cls(b.parameters(), **kw), _config("nvme", tmp_path))
    allocated: list[tuple] = []
    zeros_like = torch.zeros_like
    monkeypatch.setattr(torch, "zeros_like", lambda t, **k: allocated.append(tuple(t.shape)) or zeros_like(t, **k))
    _single_process(sharded.load_optimizer, b, ob, tmp_path / "ck", 0, meta)
    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    assert allocated == []  # no host tensor for exp_avg / exp_avg_sq: read into the files
    for p in b.parameters():  # the targets are the swap files' memory
        for key in ("exp_avg", "exp_avg_sq"):
            target = ob.checkpoint_target(p, key)
            assert torch.equal(target, ob.state[p][key])
    _train(a, oa, 3, seed=2)
    _train(b, ob, 3, seed=2)
    assert _max_diff(a, b) == 0.0
    # Host (RAM) offload offers no target: the reader allocates as for any optimizer.
    oc = OffloadOptimizer(cls(_net().parameters(), **kw), _config("cpu", tmp_path))
    assert oc.checkpoint_target(next(iter(oc.param_groups[0]["params"])), "exp_avg") is None
    for o in (oa, ob, oc):
        o.close()

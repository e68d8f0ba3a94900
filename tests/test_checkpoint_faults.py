"""Damaged and incomplete checkpoints, and `zeropp consolidate` on every front end's layout.

    python -m pytest tests/test_checkpoint_faults.py -q

One spawned group of 2 gloo ranks writes an Accelerate ``save_state``, Fabric checkpoints
and a Lightning checkpoint, then damages copies of them (rank 0) and loads each on both
ranks: a truncated shard, a flipped byte, a missing shard, a ``zeropp_meta.pt`` from
another save, a full disk during a save (a small tmpfs the test mounts). Every rank must
raise an error naming the file and the fix; the good checkpoint must still load exactly.
The single-process tests after it consolidate the group's checkpoints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.timeout(360)  # its longest run_ranks timeout + 60 s (pyproject's 300 s would cut it)

WIDTH = 128  # Net(width=128): ~2.4 MB per checkpoint with AdamW state, so a shard dominates it


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the middle of the file: tensor bytes, which nothing but a checksum notices
    path.write_bytes(bytes(data))


def _damage(good: Path, tmp: Path, other: Path) -> list[str]:
    """Rank 0: damaged copies of the sharded checkpoint ``good``; returns their names."""
    cases = {}
    for name in ("truncated", "flipped", "missing", "foreign_meta", "unverified"):
        cases[name] = shutil.copytree(good, tmp / name)
    shard = sorted(p.name for p in good.glob("*.distcp"))[-1]
    with open(cases["truncated"] / shard, "r+b") as f:
        f.truncate((cases["truncated"] / shard).stat().st_size // 2)
    _flip_byte(cases["flipped"] / shard)
    (cases["missing"] / shard).unlink()
    shutil.copy(other / "zeropp_meta.pt", cases["foreign_meta"] / "zeropp_meta.pt")
    (cases["unverified"] / "zeropp_checksums.json").unlink(missing_ok=True)  # as saved before checksums existed
    return sorted(cases)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _accelerate_part(rank: int, tmp: Path) -> None:
    """A sharded save_state of a tiny Llama after one AdamW step, and its full reference state."""
    from transformers import LlamaForCausalLM

    from tests._models import tiny_llama_config
    from zeropp_strategy.accelerate import ZeroPPAccelerator
    from zeropp_strategy.engine.state import full_optimizer_state

    accelerator = ZeroPPAccelerator(zero_config={"stage": 3})
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(rank))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()
    accelerator.save_state(str(tmp / "accel"))
    ref = {"model_0": accelerator.get_state_dict(model), "optimizer_0": full_optimizer_state(opt.optimizer)}
    if rank == 0:
        torch.save(ref, tmp / "accel.ref")
    accelerator.wait_for_everyone()


def _attempt(fn) -> str:
    try:
        fn()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - the message is what the test checks (DCP's is a BaseException)
        return f"{type(err).__name__}: {err}"
    return "ok"


def _worker(rank, world, tmp, disk):
    from lightning.fabric import Fabric

    import zeropp_strategy  # noqa: F401 - registers the strategy names
    from tests._models import Net, dataset
    from zeropp_strategy.engine.state import full_model_state, full_optimizer_state
    from zeropp_strategy.fabric import _unwrap

    tmp = Path(tmp)
    out = {}
    _accelerate_part(rank, tmp)

    fabric = Fabric(strategy="zeropp_stage_3", accelerator="cpu", devices=world, precision="32-true")
    fabric.launch()
    torch.manual_seed(1234)
    model = Net(width=WIDTH)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = dataset()[:8]

    def step():
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()

    def full():
        return full_model_state(_unwrap(model)), full_optimizer_state(opt)

    def load(path):
        fabric.load(path, {"model": model, "optimizer": opt})

    step()
    fabric.save(tmp / "good", {"model": model, "optimizer": opt, "step": 1})
    good = full()
    if rank == 0:
        torch.save(good, tmp / "fabric.ref")
    step()
    fabric.save(tmp / "other", {"model": model, "optimizer": opt, "step": 2})
    strategy = fabric.strategy
    cases = _damage(tmp / "good", tmp, tmp / "other") if rank == 0 else None
    cases = strategy.broadcast(cases)
    for name in cases:
        out[name] = _attempt(lambda: load(tmp / name))
        out[f"{name}_state"] = _equal(full(), good) if out[name] == "ok" else None
    out["good_after"] = _attempt(lambda: load(tmp / "good"))
    out["good_after_state"] = _equal(full(), good)

    if disk is not None:  # a file system with room for one checkpoint and a half
        disk = Path(disk)
        if rank == 0:
            size = sum(p.stat().st_size for p in (tmp / "good").iterdir())
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * max(0, free - size * 3 // 2))
        strategy.barrier()
        out["first_save"] = _attempt(lambda: fabric.save(disk / "ckpt", {"model": model, "optimizer": opt}))
        before = full()
        step()
        out["full_disk"] = _attempt(lambda: fabric.save(disk / "ckpt", {"model": model, "optimizer": opt}))
        strategy.barrier()
        out["full_disk_leftovers"] = sorted(p.name for p in disk.iterdir())
        out["after_full_disk"] = _attempt(lambda: load(disk / "ckpt"))
        out["after_full_disk_state"] = _equal(full(), before)

    # The Lightning strategy reads the same files through its own loader.
    from lightning.pytorch import Trainer

    from tests._models import ParityModule, trainer_kwargs
    from zeropp_strategy import ZeroPPStrategy

    t = Trainer(strategy=ZeroPPStrategy(stage=3), **trainer_kwargs(world, max_steps=2))
    t.fit(ParityModule())
    t.save_checkpoint(tmp / "lit.ckpt", weights_only=False)
    if rank == 0:
        shutil.copytree(tmp / "lit.ckpt", tmp / "lit_flipped.ckpt")
        _flip_byte(tmp / "lit_flipped.ckpt" / "__1_0.distcp")
    t.strategy.barrier()
    t = Trainer(strategy=ZeroPPStrategy(stage=3), **trainer_kwargs(world, max_steps=3))
    out["lightning_flipped"] = _attempt(lambda: t.fit(ParityModule(), ckpt_path=tmp / "lit_flipped.ckpt"))
    return out


def _full_worker(rank, world, tmp):
    """A full-format Fabric file comes from a run of its own: the format is the session's plan,
    decided at setup, so a Fabric set up with state_dict_type="full" loads "other" and saves."""
    from lightning.fabric import Fabric

    from tests._models import Net
    from zeropp_strategy.fabric import ZeroPPFabricStrategy

    tmp = Path(tmp)
    fabric = Fabric(strategy=ZeroPPFabricStrategy(stage=3, state_dict_type="full"), accelerator="cpu",
                    devices=world, precision="32-true")
    fabric.launch()
    torch.manual_seed(1234)
    model = Net(width=WIDTH)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fabric.load(tmp / "other", {"model": model, "optimizer": opt})
    fabric.save(tmp / "fabric_full.ckpt", {"model": model, "optimizer": opt, "step": 2})
    return (tmp / "fabric_full.ckpt").is_file()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(tmp dir, per-rank results) of the one spawned group; mounts and unmounts the tmpfs."""
    tmp = tmp_path_factory.mktemp("faults")
    disk = tmp / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                             capture_output=True, text=True).returncode == 0
    try:
        results = run_ranks(_worker, 2, (str(tmp), str(disk) if mounted else None), timeout_s=300)
        assert all(run_ranks(_full_worker, 2, (str(tmp),), timeout_s=120))
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)
    return tmp, results, mounted


@pytest.mark.parametrize(
    ("case", "pattern"),
    [
        ("truncated", r"__1_0\.distcp has \d+ bytes, \d+ were written \(truncated"),
        ("flipped", r"__1_0\.distcp has the right size but not the content that was written"),
        ("missing", r"__1_0\.distcp is missing"),
        ("foreign_meta", r"zeropp_meta\.pt has .*(replaced|another)"),
    ],
)
def test_damaged_checkpoint_fails_on_every_rank_and_the_good_one_still_loads(group, case, pattern):
    import re

    _, results, _ = group
    for rank, out in enumerate(results):
        message = out[case]
        assert re.search(pattern, message) and "Fix:" in message and "CheckpointError" in message, (rank, message)
        assert "\n" not in message, (rank, message)
        assert out["good_after"] == "ok" and out["good_after_state"], (rank, out["good_after"])
    assert results[0][case] == results[1][case]  # the same error, wherever the bad file was read


def test_checkpoint_without_checksums_still_loads(group):
    _, results, _ = group
    for out in results:
        assert out["unverified"] == "ok" and out["unverified_state"], out["unverified"]


def test_full_disk_fails_on_every_rank_and_keeps_the_previous_checkpoint(group):
    import re

    _, results, mounted = group
    if not mounted:
        pytest.skip("mounting a tmpfs is not permitted here (needs root): the full-disk case did not run")
    for rank, out in enumerate(results):
        assert out["first_save"] == "ok", out["first_save"]
        message = out["full_disk"]
        # Whichever rank's error names the cause: DCP's OSError, or torch.save's stream error on a full disk.
        assert re.search(r"could not save the checkpoint \S*disk/ckpt \(rank \d: .*\d+ bytes are free there", message)
        assert "No space left on device" in message or "the disk is full" in message, (rank, message)
        assert "previous checkpoint" in message and "Fix:" in message, (rank, message)
        assert out["full_disk_leftovers"] == ["ckpt", "filler"], out["full_disk_leftovers"]  # no .tmp- left
        assert out["after_full_disk"] == "ok" and out["after_full_disk_state"], (rank, out["after_full_disk"])


def test_lightning_strategy_refuses_a_flipped_byte_on_every_rank(group):
    for rank, out in enumerate(group[1]):
        message = out["lightning_flipped"]
        assert "lit_flipped.ckpt is damaged" in message and "__1_0.distcp" in message, (rank, message)


# -- zeropp consolidate: every front end's layout, and what it refuses ------------------------


def _cli(argv, capsys):
    from zeropp_strategy.cli import main

    code = main(["consolidate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_consolidate_accelerate_state(group, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from tests._models import tiny_llama_config

    tmp, _, _ = group
    ref = torch.load(tmp / "accel.ref", weights_only=True)
    for src in (tmp / "accel", tmp / "accel" / "zeropp_state"):  # the save_state folder, or the part in it
        out = tmp_path / f"{src.name}.pt"
        code, stdout, _ = _cli([src, out], capsys)
        assert code == 0 and "wrote" in stdout
        full = torch.load(out, weights_only=True)
        assert _equal(full["model_0"], ref["model_0"]) and _equal(full["optimizer_0"], ref["optimizer_0"])
        assert full["zeropp"]["modules"] == ["model_0"] and full["zeropp"]["optimizers"] == {"optimizer_0": "model_0"}
    code, _, _ = _cli([tmp / "accel", tmp_path / "hf", "--hf"], capsys)
    assert code == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reference = LlamaForCausalLM(tiny_llama_config())
    reference.load_state_dict(ref["model_0"])
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, reference(ids).logits)


def test_consolidate_fabric_checkpoint_in_fabric_layout(group, tmp_path, capsys):
    tmp, _, _ = group
    ref_model, ref_optim = torch.load(tmp / "fabric.ref", weights_only=True)
    code, _, _ = _cli([tmp / "good", tmp_path / "out.ckpt"], capsys)
    assert code == 0
    full = torch.load(tmp_path / "out.ckpt", weights_only=True)
    assert [k for k in full if k != "zeropp"] == ["step", "model", "optimizer"]
    assert full["step"] == 1 and _equal(full["model"], ref_model) and _equal(full["optimizer"], ref_optim)
    # A full Fabric file is recognised as such: nothing to consolidate.
    code, _, err = _cli([tmp / "fabric_full.ckpt", tmp_path / "x.ckpt"], capsys)
    assert code == 2 and "already a full (one-file) fabric checkpoint" in err and "Fix:" in err


def test_consolidate_refuses_damaged_and_unknown_input_in_one_line(group, tmp_path, capsys):
    tmp, _, _ = group
    torch.save({"weights": torch.ones(2), "epoch": 3}, tmp_path / "plain.pt")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.bin").write_bytes(b"x")
    cases = {
        tmp / "flipped": r"flipped is damaged: .*__1_0\.distcp has the right size",
        tmp / "foreign_meta": r"zeropp_meta\.pt",
        tmp_path / "plain.pt": r"holding a dict with keys \['epoch', 'weights'\], not a checkpoint layout",
        tmp_path / "notes.txt": r"notes\.txt \(16 bytes\) could not be read by torch\.load",
        tmp_path / "folder": r"no zeropp_meta\.pt .*it holds a\.bin",
    }
    import re

    for src, pattern in cases.items():
        code, stdout, err = _cli([src, tmp_path / "out.ckpt"], capsys)
        assert code == 2 and stdout == "" and err.count("\n") == 1, (src, err)
        assert re.search(pattern, err) and "Fix:" in err and "Traceback" not in err, (src, err)
    assert not (tmp_path / "out.ckpt").exists()


def test_consolidate_never_writes_an_empty_or_partial_result(group, tmp_path):
    from zeropp_strategy.checkpoint.consolidate import consolidate
    from zeropp_strategy.checkpoint.integrity import CheckpointError, record

    tmp, _, _ = group
    for name, edit, pattern in (
        ("empty", lambda meta: meta.update(modules=["nope"], optimizers={}), r"wrote 0 of 0 model tensors.*empty"),
        ("partial", lambda meta: meta.update(optimizers={}), r"wrote \d+ of \d+ tensors of the checkpoint.*partial"),
    ):
        ckpt = shutil.copytree(tmp / "accel" / "zeropp_state", tmp_path / name)
        meta = torch.load(ckpt / "zeropp_meta.pt", weights_only=True)
        edit(meta)
        torch.save(meta, ckpt / "zeropp_meta.pt")
        (ckpt / "zeropp_checksums.json").unlink()
        record(ckpt)  # checksums of the edited files: the checkpoint is consistent, just incomplete
        with pytest.raises(CheckpointError, match=pattern):
            consolidate(ckpt, tmp_path / f"{name}.ckpt")
        assert not list(tmp_path.glob(f"{name}.ckpt*")), "nothing is left behind"


def test_a_flipped_byte_in_a_full_checkpoint_is_refused_with_the_file_named(tmp_path):
    """Full (one-file) checkpoints: torch.save's zip entries carry CRC-32s that torch.load
    does not check; safe_load checks them first (integrity.verify_file)."""
    import torch

    from zeropp_strategy.checkpoint.atomic import atomic_torch_save, safe_load
    from zeropp_strategy.checkpoint.integrity import CheckpointError

    state = {"state_dict": {"w": torch.randn(256, 256), "b": torch.zeros(256)}, "epoch": 3}
    path = tmp_path / "full.ckpt"
    atomic_torch_save(state, path)
    assert torch.equal(safe_load(path)["state_dict"]["w"], state["state_dict"]["w"])
    _flip_byte(path)  # the middle of the file: inside w's bytes
    assert torch.load(path, weights_only=True)["epoch"] == 3  # torch alone loads it, silently wrong
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is damaged: its entry .*data/\d+ Bad CRC-32.*"
                                              r"Nothing was loaded from it\. Fix: "):
        safe_load(path)

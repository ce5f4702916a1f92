"""Checkpoints written whole or not at all, the newest K kept, found again past partial and corrupt files."""

import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpidomain import checkpoints, command  # noqa: E402
from mpidomain.checkpoints import CheckpointFolder, restore_rng_states, rng_states, save_atomic  # noqa: E402
from mpitest import share  # noqa: E402


def folder_of(world, tmp_path):
    return share(world, str(tmp_path) if world.rank == 0 else None)


def test_save_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = str(tmp_path / "state.pt")
    save_atomic({"step": 1}, path)
    assert torch.load(path)["step"] == 1 and os.listdir(tmp_path) == ["state.pt"]

    def full(obj, file):
        file.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoints.torch, "save", full)
    with pytest.raises(OSError, match="No space left"):
        save_atomic({"step": 2}, path)
    assert torch.load(path)["step"] == 1 and os.listdir(tmp_path) == ["state.pt"]  # no partial file left


def test_the_newest_k_are_kept_and_latest_points_at_the_newest(world, tmp_path):
    folder = folder_of(world, tmp_path)
    saved = CheckpointFolder(folder, keep=2, latest="checkpoint.pt")
    comm = command.world()

    def contents():
        # Listed on rank 0 and shared: another rank listing alone could see rank 0's next save under way.
        return share(world, (sorted(os.listdir(folder)), torch.load(os.path.join(folder, "checkpoint.pt"))["step"])
                     if world.rank == 0 else None)

    for step in (1, 2, 3, 4):
        assert saved.save(comm, {"step": step}, step) == os.path.join(folder, f"checkpoint-{step:06d}.pt")
    assert contents() == (["checkpoint-000003.pt", "checkpoint-000004.pt", "checkpoint.pt"], 4)
    saved.save(comm, {"step": 2}, 2)  # a run resumed from an older checkpoint replaces the later ones
    assert contents() == (["checkpoint-000002.pt", "checkpoint.pt"], 2)


def test_newest_skips_partial_and_corrupt_files_naming_each(world, tmp_path):
    folder = folder_of(world, tmp_path)
    saved = CheckpointFolder(folder)
    comm = command.world()
    assert saved.newest(comm) == (None, None, [])
    saved.save(comm, {"step": 3, "ok": True}, 3)
    if world.rank == 0:
        with open(saved.path(5) + ".partial", "wb") as file:
            file.write(b"half")
        with open(saved.path(4), "w") as file:
            file.write("not a checkpoint")
    comm.Barrier()
    path, state, skipped = saved.newest(comm)
    assert path == saved.path(3) and state == {"step": 3, "ok": True}
    assert [os.path.basename(p) for p, _ in skipped] == ["checkpoint-000005.pt.partial", "checkpoint-000004.pt"]
    assert "partial" in skipped[0][1] and "UnpicklingError" in skipped[1][1]

    def only_even(state):
        if state["step"] % 2:
            raise ValueError("odd")
    assert saved.newest(comm, check=only_even)[0] is None


def test_a_failed_save_raises_on_every_rank_and_keeps_the_previous_newest(world, tmp_path, monkeypatch):
    folder = folder_of(world, tmp_path)
    saved = CheckpointFolder(folder, latest="checkpoint.pt")
    comm = command.world()
    saved.save(comm, {"step": 1}, 1)

    def full(obj, file):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoints.torch, "save", full)
    with pytest.raises(RuntimeError, match=r"could not write the checkpoint .*checkpoint-000002.pt \(OSError: "
                                           r"\[Errno 28\] No space left on device\); the newest complete checkpoint is "
                                           r"still .*checkpoint-000001.pt"):
        saved.save(comm, {"step": 2}, 2)
    monkeypatch.undo()
    assert saved.newest(comm)[0] == saved.path(1)
    assert share(world, torch.load(os.path.join(folder, "checkpoint.pt"))["step"] if world.rank == 0 else None) == 1


def test_rng_states_round_trip():
    states = rng_states()
    drawn = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == drawn

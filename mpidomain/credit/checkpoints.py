"""``credit train``'s checkpoints in CREDIT's layout, written whole or not at all, found again for ``--resume``.

``save_loc/checkpoint.pt`` after every epoch holds CREDIT's keys (``epoch``, ``model_state_dict``
under the unwrapped model's names, ``optimizer_state_dict``, ``scheduler_state_dict``,
``scaler_state_dict``), so CREDIT's own loader takes it in one process; the previous one is copied to
``backup_checkpoint.pt`` when the next epoch starts, the best to ``best_checkpoint.pt``, the EMA
weights to ``checkpoint_ema.pt``, as CREDIT does. ``--checkpoint-every N`` adds numbered
``checkpoint-step-<step>.pt`` files (the newest ``--keep`` kept) with the same keys. Every file
also carries an ``mpidomain`` entry (the step, the epoch's position, its logs so far, the random
generators of each data-parallel group) that makes a resume at the same layout continue bit for
bit; it holds only tensors and plain Python values, so ``torch.load(weights_only=True)`` (CREDIT's
loader) reads it.
"""

import os
import random
import shutil

import numpy as np
import torch

from .._agreement import agree
from .._errors import raised_alike
from ..checkpoints import CheckpointFolder, save_atomic
from ..command import UsageError

__all__ = ["FORMAT", "EpochFiles", "pack_rng", "unpack_rng", "step_folder", "read_checkpoint", "newest_state"]

FORMAT = "mpidomain-credit-train-1"
STEP_PREFIX = "checkpoint-step"


def pack_rng():
    """This process's random generators (Python, NumPy, torch CPU and CUDA) as tensors and plain values."""
    name, keys, position, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(position),
                                                     int(has_gauss), float(cached)],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def unpack_rng(state):
    """Restore what :func:`pack_rng` saved."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_folder(save_loc, keep):
    """The :class:`~mpidomain.checkpoints.CheckpointFolder` of the numbered step checkpoints."""
    return CheckpointFolder(save_loc, STEP_PREFIX, keep=keep)


def _copy_atomic(source, target):
    """Copy ``source`` to ``target`` whole or not at all (a ``.partial`` file renamed into place); local."""
    partial = target + ".partial"
    try:
        shutil.copyfile(source, partial)
        os.replace(partial, target)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise


def _alike(comm, message):
    """Raise RuntimeError with rank 0's ``message`` on every rank if it is not None there."""
    if agree(comm, "credit train: writing a checkpoint", None, flag=message is not None):
        raise raised_alike(RuntimeError(comm.bcast(message, root=0)))


class EpochFiles:
    """CREDIT's per-epoch files in ``save_loc``; every method is collective over ``comm`` (rank 0 writes)."""

    def __init__(self, comm, save_loc):
        self.comm, self.save_loc = comm, save_loc
        self.path = os.path.join(save_loc, "checkpoint.pt")

    def _rank0(self, work, what):
        message = None
        if self.comm.Get_rank() == 0:
            try:
                work()
            except OSError as error:
                message = (f"could not {what} in {self.save_loc} ({type(error).__name__}: {error}); free space or "
                           "make the folder writable, then resume with --resume auto")
        _alike(self.comm, message)

    def save(self, state, ema_state=None, epoch=None, every_epoch=False):
        """Write ``checkpoint.pt`` (and ``checkpoint_ema.pt``; with ``every_epoch`` CREDIT's numbered copy)."""
        def work():
            save_atomic(state, self.path)
            if ema_state is not None:
                save_atomic({"epoch": state["epoch"], "model_state_dict": ema_state},
                            os.path.join(self.save_loc, "checkpoint_ema.pt"))
            if every_epoch:
                _copy_atomic(self.path, f"{self.path}{epoch:05}.pt")
        self._rank0(work, "write checkpoint.pt")

    def backup(self):
        """Copy ``checkpoint.pt`` to ``backup_checkpoint.pt`` (CREDIT: as the next epoch starts)."""
        def work():
            if os.path.exists(self.path):
                _copy_atomic(self.path, os.path.join(self.save_loc, "backup_checkpoint.pt"))
        self._rank0(work, "copy checkpoint.pt to backup_checkpoint.pt")

    def best(self):
        """Copy ``checkpoint.pt`` and ``checkpoint_ema.pt`` to their ``best_`` names."""
        def work():
            for name in ("checkpoint.pt", "checkpoint_ema.pt"):
                source = os.path.join(self.save_loc, name)
                if os.path.exists(source):
                    _copy_atomic(source, os.path.join(self.save_loc, f"best_{name}"))
        self._rank0(work, "copy the best checkpoint")


def _check(state, path):
    if not isinstance(state, dict) or "model_state_dict" not in state:
        raise ValueError(f"{path}: not a CREDIT checkpoint (no model_state_dict); give a checkpoint.pt that credit "
                         "train or python -m mpidomain credit train saved")


def read_checkpoint(comm, path, what="--resume"):
    """Load ``path`` on every rank (CPU); UsageError alike on every rank if it is missing or unreadable."""
    state, error = None, None
    try:
        if not os.path.isfile(path):
            raise FileNotFoundError("no such file")
        state = torch.load(path, map_location="cpu", weights_only=False)
        _check(state, path)
    except (OSError, ValueError, RuntimeError, EOFError, KeyError) as exc:
        error = UsageError(f"{what} {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; give a "
                           "checkpoint.pt a CREDIT run saved, or --resume auto")
    agree(comm, f"credit train: {what}", None, error=error)
    return state


def state_step(state, batches_per_epoch):
    """The optimizer steps done before ``state``: ours, or CREDIT's epochs times the steps of an epoch."""
    extra = state.get("mpidomain") if isinstance(state, dict) else None
    if isinstance(extra, dict) and "step" in extra:
        return int(extra["step"])
    return (int(state.get("epoch", -1)) + 1) * batches_per_epoch


def newest_state(comm, save_loc, keep, batches_per_epoch):
    """``--resume auto``: return ``(path, state, skipped)`` of the newest complete checkpoint in ``save_loc``.

    The newest numbered step checkpoint that loads, or CREDIT's ``checkpoint.pt`` if it is after it (or the
    only one); ``(None, None, skipped)`` if there is none. Collective over ``comm``.
    """
    path, state, skipped = step_folder(save_loc, keep).newest(comm, check=lambda s: _check(s, "checkpoint"))
    epoch_path = os.path.join(save_loc, "checkpoint.pt")
    has_epoch = comm.bcast(os.path.isfile(epoch_path) if comm.Get_rank() == 0 else None, root=0)
    if has_epoch:
        epoch_state = read_checkpoint(comm, epoch_path, "--resume auto")
        if state is None or state_step(epoch_state, batches_per_epoch) >= state_step(state, batches_per_epoch):
            return epoch_path, epoch_state, skipped
    return path, state, skipped

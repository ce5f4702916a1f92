"""Checkpoints that a kill cannot corrupt: written whole or not at all, the newest K kept, found again.

:func:`save_atomic` writes a file under a ``.partial`` name, flushes it to
disk and renames it into place, so a file under the final name is always
whole. :class:`CheckpointFolder` numbers a run's checkpoints by step, keeps
the newest ``keep``, and finds the newest one that loads (skipping partial
and corrupt files, each named). :func:`rng_states` and
:func:`restore_rng_states` carry every random generator a run draws from, so
a resumed run draws what the uninterrupted one would. Needs torch.
"""

import os
import random
import re
import shutil

import numpy as np
import torch

from ._agreement import agree
from ._errors import describe_error, raised_alike

__all__ = ["CheckpointFolder", "restore_rng_states", "rng_states", "save_atomic"]


def _sync_folder(folder):
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # a file system without directory handles: the rename is what it is
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


class _Writer:
    """A file for ``torch.save`` that keeps the first OSError of a write (torch reports its own error instead)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data):
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self):
        self.file.flush()


def save_atomic(obj, path):
    """Save ``obj`` (``torch.save``) to ``path`` whole or not at all; local.

    Writes ``path + ".partial"`` in the same folder, flushes it to disk, then renames it to ``path`` (replacing
    an older file) and flushes the folder. A failure (a full disk, a read-only folder) removes the partial file,
    leaves ``path`` as it was, and raises the OSError.
    """
    path = os.fspath(path)
    partial = path + ".partial"
    try:
        with open(partial, "wb") as file:
            writer = _Writer(file)
            try:
                torch.save(obj, writer)
            except RuntimeError:  # torch's writer reports a failed write as its own error: the OSError says why
                if writer.error is not None:
                    raise writer.error from None
                raise
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise
    _sync_folder(os.path.dirname(os.path.abspath(path)))


def _point(name, path):
    """Make ``name`` hold the file ``path`` (a hard link, else a copy), atomically; local."""
    partial = name + ".partial"
    try:
        if os.path.lexists(partial):
            os.remove(partial)
        os.link(path, partial)
    except OSError:  # no hard links here: a copy, flushed
        shutil.copyfile(path, partial)
        with open(partial, "rb+") as file:
            os.fsync(file.fileno())
    os.replace(partial, name)


def rng_states():
    """Return the states of Python's ``random``, NumPy's global generator and torch's CPU and CUDA generators."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states):
    """Set the generators :func:`rng_states` read to ``states``; local."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class CheckpointFolder:
    """A run's numbered checkpoints in ``folder``: ``<prefix>-<step:06d>.pt``, the newest ``keep`` kept.

    With ``latest`` (a file name such as ``"checkpoint.pt"``), that name in ``folder`` always holds the newest
    checkpoint too (a hard link where the file system has them, else a copy; replaced atomically).

    Collective methods take the communicator of the ranks that share the run (every rank of the job); world
    rank 0 of it writes and lists, so the folder must be one path every rank sees (a shared file system).
    """

    def __init__(self, folder, prefix="checkpoint", keep=3, latest=None):
        if keep < 1:
            raise ValueError(f"CheckpointFolder: keep must be >= 1, got {keep}")
        self.folder, self.prefix, self.keep = os.fspath(folder), prefix, keep
        self.latest = None if latest is None else os.path.join(self.folder, latest)
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d{{6,}})\.pt")

    def path(self, step):
        """Return the path of the checkpoint after ``step``."""
        return os.path.join(self.folder, f"{self.prefix}-{step:06d}.pt")

    def _listed(self):
        """``(step, name)`` of every file named like a checkpoint (complete or not), newest first; local."""
        found = []
        for name in os.listdir(self.folder) if os.path.isdir(self.folder) else ():
            match = self._pattern.fullmatch(name[:-len(".partial")] if name.endswith(".partial") else name)
            if match:
                found.append((int(match.group(1)), name))
        return sorted(found, reverse=True)

    def saved(self):
        """The paths of the complete checkpoints in the folder, newest first; local (list it on one rank)."""
        return [os.path.join(self.folder, name) for _, name in self._listed() if not name.endswith(".partial")]

    def _prune(self, step):
        """Remove partial files, checkpoints of a run this one replaced (steps after ``step``), and all but the
        newest ``keep`` complete checkpoints; local."""
        kept = 0
        for old_step, name in self._listed():
            if not name.endswith(".partial") and old_step <= step and kept < self.keep:
                kept += 1
                continue
            os.remove(os.path.join(self.folder, name))

    def save(self, comm, state, step):
        """Save ``state`` as the checkpoint after ``step``; remove all but the newest ``keep``; return its path.

        Files of a run this one replaced (steps after ``step``, from a resume of an older checkpoint) and partial
        files left by a killed write are removed too.

        Collective over ``comm``: rank 0 writes (:func:`save_atomic`). If the write fails there (a full disk, a
        read-only folder), every rank raises the same RuntimeError naming the file and the OSError, and the
        previous newest checkpoint stays the newest.
        """
        path, message = self.path(step), None
        if comm.Get_rank() == 0:
            try:
                save_atomic(state, path)
                if self.latest is not None:
                    _point(self.latest, path)
                self._prune(step)
            except Exception as error:  # noqa: BLE001 - whatever keeps the file from being written ends the run alike
                newest = next(iter(self.saved()), None)
                message = (f"could not write the checkpoint {path} ({describe_error(error)}); "
                           f"{'the newest complete checkpoint is still ' + newest if newest else 'no checkpoint yet'}"
                           f"{'; free space or make the folder writable, then resume' if isinstance(error, OSError) else ''}")
        if agree(comm, "saving a checkpoint", step, flag=message is not None):
            raise raised_alike(RuntimeError(comm.bcast(message, root=0)), comm)
        return path

    def newest(self, comm, check=None):
        """Return ``(path, state, skipped)``: the newest complete checkpoint that loads, or ``(None, None, skipped)``.

        Collective over ``comm``: rank 0 tries the files newest first (``torch.load`` on the CPU, then
        ``check(state)``, which raises ValueError to reject one); ``skipped`` lists ``(name, reason)`` for each
        partial, corrupt or rejected file passed over, the same on every rank. Every rank then loads the chosen
        file itself.
        """
        choice, skipped = None, []
        if comm.Get_rank() == 0:
            for step, name in self._listed():
                path = os.path.join(self.folder, name)
                if name.endswith(".partial"):
                    skipped.append((path, "partial: a run was stopped while writing it"))
                    continue
                try:
                    state = torch.load(path, map_location="cpu", weights_only=False)
                    if check is not None:
                        check(state)
                except Exception as error:  # noqa: BLE001 - any unreadable file is passed over, named
                    skipped.append((path, describe_error(error)))
                    continue
                choice = path
                break
        choice, skipped = comm.bcast((choice, skipped), root=0)
        if choice is None:
            return None, None, skipped
        state = error = None
        try:
            state = torch.load(choice, map_location="cpu", weights_only=False)
        except Exception as exc:  # noqa: BLE001
            error = ValueError(f"{choice}: rank 0 loaded it, this rank could not ({type(exc).__name__}: {exc})")
        agree(comm, "loading the newest checkpoint", None, error=error)
        return choice, state, skipped

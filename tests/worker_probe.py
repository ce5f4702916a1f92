"""What tests/test_workers.py's DataLoader workers run: importable without MPI (a spawned worker imports it).

A spawned worker imports the modules of what it unpickles; this one imports neither mpi4py nor a test
module that does, so the worker's own imports show whether anything it runs loads MPI; in a forked worker
(MPI loaded and initialised, inherited), :func:`refuse_mpi` makes any use of it raise.
"""

import os
import sys

import torch

class _Refused:
    """Stands for MPI in a worker: any use raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attribute):
        raise RuntimeError(f"a DataLoader worker used {self._name}.{attribute}: workers must not call MPI")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"a DataLoader worker called {self._name}: workers must not call MPI")


def refuse_mpi(worker_id):
    """A ``worker_init_fn``: from here on, any use of ``mpi4py.MPI``'s names or of the dataset's manager raises.

    A forked worker inherits the rank's initialised MPI (a spawned one has none loaded): each name of the
    ``mpi4py.MPI`` module is replaced by a :class:`_Refused`, and so is the manager of the worker's copy of the
    dataset, the one object an item could reach communicators through.
    """
    module = sys.modules.get("mpi4py.MPI")
    if module is not None:
        for name in [n for n in vars(module) if not n.startswith("__")]:
            setattr(module, name, _Refused(f"mpi4py.MPI.{name}"))
    dataset = torch.utils.data.get_worker_info().dataset
    inner = getattr(dataset, "samples", dataset)
    if getattr(inner, "manager", None) is not None:
        inner.manager = _Refused("TileDataset.manager")


class Watched(torch.utils.data.Dataset):
    """``samples``' items, each with what its process saw: (pid, mpi4py.MPI loaded)."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        return self.samples[index], torch.tensor([os.getpid(), "mpi4py.MPI" in sys.modules])

"""TileDataset through a DataLoader with worker processes, inside the suite's MPI job (mpiexec -n 1/2/4).

Workers (``num_workers=2``, ``persistent_workers``, ``prefetch_factor``), started by ``fork`` and by ``spawn``,
give the same samples in the same order as ``num_workers=0``, two epochs running; and no worker makes an MPI
call: in a forked worker (which inherits the rank's initialised MPI) any use of ``mpi4py.MPI``'s names or of
the dataset's manager would raise, and a spawned one (pickled, without the manager) never even loads
``mpi4py.MPI``. What the workers run lives in tests/worker_probe.py, which imports no MPI: a spawned worker
imports the modules of what it unpickles (a module importing ``mpi4py.MPI`` would start MPI in the worker,
which fails inside an MPI job).
"""

import os

import pytest

torch = pytest.importorskip("torch")
xr = pytest.importorskip("xarray")
pytest.importorskip("zarr")

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.data import TileDataset  # noqa: E402
from test_data import make_dataset, write_zarr  # noqa: E402
from worker_probe import Watched, refuse_mpi  # noqa: E402

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return write_zarr(make_dataset(), tmp_path_factory.mktemp("workers") / "sample.zarr", 2)


def read_all(dataset, sampler, **loader):
    """Two epochs of a DataLoader over ``dataset``: (every batch's samples, every batch's process records)."""
    batches, seen = [], []
    data = torch.utils.data.DataLoader(Watched(dataset), batch_size=1, sampler=sampler, **loader)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for sample, record in data:
            batches.append(sample)
            seen.append(record[0].tolist())
    return batches, seen


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_give_the_samples_of_num_workers_0_and_call_no_mpi(world, store, context):
    """num_workers=2, persistent, prefetch_factor=2, under fork or spawn: the same samples in the same order as
    num_workers=0; the workers are other processes, and none calls MPI (spawned: none loads mpi4py.MPI)."""
    domain = 2 if world.size % 2 == 0 else 1
    with DomainParallelManager(world.size, domain) as manager:
        data = xr.open_zarr(store, consolidated=False, chunks=None)
        samples = TileDataset(data, ["t", "sp"], manager=manager, halo=1, boundary="earth")
        sampler = samples.sampler(seed=1)
        want, main = read_all(samples, sampler)
        got, workers = read_all(samples, sampler, num_workers=2, persistent_workers=True, prefetch_factor=2,
                                multiprocessing_context=context, worker_init_fn=refuse_mpi)
    assert len(got) == len(want) == 2 * len(sampler) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert {pid for pid, _ in main} == {os.getpid()} and os.getpid() not in {pid for pid, _ in workers}
    if context == "spawn":
        assert not any(loaded for _, loaded in workers), workers


def test_a_pickled_dataset_holds_no_manager_and_keeps_its_sampler(world, store):
    """What a spawned worker gets: the items, no manager (no communicator to call), the data-parallel place."""
    import pickle

    domain = 2 if world.size % 2 == 0 else 1
    with DomainParallelManager(world.size, domain) as manager:
        samples = TileDataset(xr.open_zarr(store, consolidated=False, chunks=None), ["sp"], manager=manager)
        copy = pickle.loads(pickle.dumps(samples))
        assert copy.manager is None and torch.equal(copy[1], samples[1])
        assert list(copy.sampler(seed=2)) == list(samples.sampler(seed=2))

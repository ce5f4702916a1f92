"""One regression test per defect of the hardening issue (#9), numbered as there.

Each ran into a hang, a wrong number or a leak on 2 or 4 ranks before the fix.
Hangs are guarded twice: the suite's timeout, and the collective verdict of
conftest.py, so a test that regresses fails instead of stalling the job.
"""

import gc
import sys
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpidomain
import mpidomain.nn
from mpidomain import (DomainParallelManager, allreduce, gather_tensor, halo_exchange, scatter_tensor,
                       sharding)
from mpidomain.halo import cache as plan_cache, call as halo_call, plan as halo
from mpitest import run_mpi, share
from reference import pad_along

torch = pytest.importorskip("torch")


@pytest.fixture
def manager(world, fresh_manager):
    """The global manager, one domain group of every rank."""
    return mpidomain.initialize_domain_parallel(world.size, world.size, abort_on_error=False)


def needs_ranks(world, n=2):
    if world.size < n:
        pytest.skip(f"needs {n} ranks")


def my_rows(counts, rank, h):
    start = sum(counts[:rank])
    return start, slice(start, start + counts[rank] + 2 * h)


def test_1_uneven_shards_after_even_ones(manager, world):
    needs_ranks(world)
    for step, extra in enumerate([0, 1, 0, 1]):  # even, then rank 0 alone holds one row more, and back
        counts = [16 + (extra if r == 0 else 0) for r in range(world.size)]
        field = np.random.default_rng(step).standard_normal((2, 3, sum(counts), 12)).astype(np.float32)
        start, window = my_rows(counts, world.rank, 1)
        shard = field[:, :, start:start + counts[world.rank]]
        padded = halo_exchange(shard, 1, dim=2)
        assert np.array_equal(padded, pad_along(field, 2, 1)[:, :, window])


def test_2_dim_spellings_share_one_plan(manager, world):
    field = np.random.default_rng(2).standard_normal((2, 3, 4 * world.size, 5))
    shard = sharding.shard_tensor(field, -2, manager)
    expected = pad_along(field, 2, 1)[:, :, my_rows([4] * world.size, world.rank, 1)[1]]
    for call in range(3):
        spelling = [None, 2, -2][(world.rank + call) % 3]
        assert np.array_equal(halo_exchange(shard, 1, dim=spelling, manager=manager), expected)
    assert len(plan_cache.cached_plans(manager)) == 1


def test_3_another_managers_work_evicts_nothing_here(manager, world):
    shard = np.ones((2, 3, 4, 5))
    halo_exchange(shard, 1, manager=manager)
    mine = plan_cache.cached_plans(manager)
    with DomainParallelManager(1, 1, comm=MPI.COMM_SELF) as alone:
        if world.rank == 0:  # one rank fills and churns its own cache
            for n in range(1, 40):
                halo_exchange(np.ones((2, n)), 1, dim=0, manager=alone)
    untouched = plan_cache.cached_plans(manager) == mine  # asserted after the exchange: only rank 0 churned
    padded = halo_exchange(shard, 1, manager=manager)
    assert untouched
    assert padded.shape == (2, 3, 6, 5)


def test_4_later_disagreements_raise_everywhere(manager, world):
    needs_ranks(world)
    shard = np.ones((2, 3, 4, 5), np.float32)
    halo_exchange(shard, 1)
    halo_exchange(shard, 1)
    with pytest.raises(ValueError, match=r"halo_width must be the same on every rank .* rank 0: 2, rank 1: 1"):
        halo_exchange(shard, 2 if world.rank == 0 else 1)
    with pytest.raises(TypeError, match=r"dtype must be the same on every rank .* rank 0: float64, rank 1: float32"):
        halo_exchange(shard.astype(np.float64) if world.rank == 0 else shard, 1)
    layer = mpidomain.nn.HaloExchange(1)
    x = torch.ones(2, 3, 4, 5, dtype=torch.float64 if world.rank == 0 else torch.float32)
    with pytest.raises(TypeError, match=r"dtype must be the same .* rank 0: torch.float64, rank 1: torch.float32"):
        layer(x)
    assert np.array_equal(halo_exchange(shard, 1)[:, :, 1:-1], shard)  # and the plans still work


def test_5_library_messages_never_meet_the_users(manager, world):
    needs_ranks(world)
    pending = np.full(1, -1, np.int64)
    user = manager.domain_group.Irecv([pending, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    full = np.arange(4.0 * world.size * 3).reshape(4 * world.size, 3) if world.rank == 0 else None
    mine = scatter_tensor(full, dim=0)
    gathered = gather_tensor(mine, dim=0)
    assert allreduce(np.ones(2)).tolist() == [world.size] * 2
    halo_exchange(mine, 1, dim=0)
    assert not user.Test()  # nothing of ours arrived on the user's communicator
    assert np.array_equal(gathered, np.arange(4.0 * world.size * 3).reshape(4 * world.size, 3))
    manager.domain_group.Send([np.array([7], np.int64), MPI.INT64_T], dest=world.rank, tag=5)
    user.Wait()
    assert pending[0] == 7


def test_6_one_rank_without_an_array_raises_everywhere(manager, world):
    last = world.rank == world.size - 1
    good = np.ones((2, 3))
    with pytest.raises(TypeError, match="expected a NumPy array, CuPy array or Torch tensor, got builtins.NoneType"):
        gather_tensor(None if last else good, dim=0)
    with pytest.raises(TypeError, match="got builtins.float"):
        allreduce(1.0 if last else good)
    if world.size > 1:  # one rank skips a halo exchange and goes on to the next collective
        with pytest.raises(RuntimeError, match=r"different mpidomain calls \(rank 0: halo_exchange.*allreduce"):
            if last:
                allreduce(good)
            else:
                halo_exchange(good, 1, dim=0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_7_half_precision_in_any_layout(manager, world, dtype):
    if True:
        transposed = torch.arange(6.).reshape(3, 2).t().to(getattr(torch, dtype)).requires_grad_()
        reduced = allreduce(transposed)
        assert torch.equal(reduced.float(), torch.arange(6.).reshape(3, 2).t() * world.size)
        grad = torch.arange(6.).reshape(2, 3).t().t().to(transposed.dtype)
        reduced.backward(grad)
        assert torch.equal(transposed.grad.float(), grad.float() * world.size)
        nhwc = torch.arange(24.).reshape(1, 4, 3, 2).to(memory_format=torch.channels_last).to(getattr(torch, dtype))
        assert torch.equal(allreduce(nhwc).float(), torch.arange(24.).reshape(1, 4, 3, 2) * world.size)


def test_8_non_native_byte_order(manager, world):
    swapped = ">f4" if sys.byteorder == "little" else "<f4"
    values = np.arange(6, dtype=swapped).reshape(3, 2)
    reduced = allreduce(values)
    assert reduced.dtype == np.dtype(swapped) and np.array_equal(reduced, np.arange(6.).reshape(3, 2) * world.size)
    full = np.arange(2 * world.size * 2, dtype=swapped).reshape(2 * world.size, 2)
    mine = scatter_tensor(full if world.rank == 0 else None, dim=0)
    assert mine.dtype == np.dtype(swapped) and np.array_equal(mine, full[2 * world.rank:2 * world.rank + 2])
    gathered = gather_tensor(mine, dim=0)
    assert gathered.dtype == np.dtype(swapped) and np.array_equal(gathered, full)
    if world.size > 1:  # byte orders that differ across ranks are different dtypes
        with pytest.raises(ValueError, match="gather_tensor needs the same dtype"):
            gather_tensor(mine if world.rank else mine.astype(np.float32), dim=0)


def test_9_unsharded_dims_pad_locally(manager, world):
    field = np.random.default_rng(9 + world.rank).standard_normal((2, 3, 4, 6))  # each rank its own band
    for periodic in (True, False):
        padded = halo_exchange(field, 2, dim=-1, periodic=periodic)
        assert np.array_equal(padded, pad_along(field, 3, 2, periodic))


def test_10_halo_exchange_keeps_the_graph(manager, world):
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    padded = halo_exchange(x, 1)
    assert padded.requires_grad
    padded.sum().backward()
    # Each row is sent to the neighbours' ghosts: the adjoint adds their gradients back.
    expected = torch.ones_like(x)
    if world.size > 1:
        if world.rank > 0:
            expected[:, :, 0] += 1
        if world.rank < world.size - 1:
            expected[:, :, -1] += 1
    assert torch.equal(x.grad, expected)


def test_11_zero_d_means_and_conjugate_views(manager, world):
    mean = allreduce(np.array(2.5), op="mean")
    assert mean.shape == () and mean == 2.5
    z = torch.tensor([1 + 2j, 3 - 1j]).conj()
    assert torch.equal(allreduce(z), torch.tensor([1 - 2j, 3 + 1j]) * world.size)
    padded = halo_exchange(z.reshape(2, 1), 1, dim=1, periodic=True)
    assert torch.equal(padded, torch.tensor([1 - 2j, 3 + 1j]).reshape(2, 1).repeat(1, 3))


def test_12_gather_frees_every_datatype(manager, world, monkeypatch):
    made = []
    for name in ("_placed_types", "_row_type"):
        original = getattr(sharding, name)

        def recording(*args, _original=original):
            result = _original(*args)
            made.extend(result if isinstance(result, list) else [result])
            return result

        monkeypatch.setattr(sharding, name, recording)
    mine = np.ones((2, 3, 5))
    for _ in range(3):
        gather_tensor(mine, dim=1)
    if world.size > 1:
        assert made and all(t is None or t == MPI.DATATYPE_NULL for t in made), "a committed datatype was not freed"


def test_13_dropped_plans_and_managers_are_reclaimed(world):
    with DomainParallelManager(world.size, world.size) as m:
        shard = np.ones((3, 4))
        for n in range(2500):  # more plans than MPI has communicators: a plan owns none
            plan = mpidomain.HaloPlan(shard, 1, dim=0, manager=m)
            assert plan.live_handles() == plan.live_handles()  # requests and datatypes only
        del plan
        gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DomainParallelManager(world.size, world.size)  # dropped unclosed
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "close()" in str(w.message) for w in caught)


def test_14_held_results_are_never_reused(manager, world):
    shard = np.random.default_rng(14 + world.rank).standard_normal((4, 5))
    results = [halo_exchange(shard * k, 1, dim=0) for k in range(5)]
    copies = [r.copy() for r in results]
    del results[1], copies[1]
    for _ in range(3):
        halo_exchange(shard, 1, dim=0)
    assert all(np.array_equal(r, c) for r, c in zip(results, copies))
    assert all("getrefcount" not in open(module.__file__).read() for module in (halo, halo_call))


def _run_cli(world, args):
    """Run ``python -m mpidomain`` in a fresh 2-rank job on rank 0; share (status, stderr) with every rank."""
    result = None
    if world.rank == 0:
        done = run_mpi(2, ["-m", "mpidomain", *args], timeout=60)
        result = (done.returncode, done.stderr)
    return share(world, result)


@pytest.mark.parametrize("args, message", [
    (["check", "-D", "0"], "expected a positive rank count such as 4 or positive tiles such as 2x2, got '0'"),
    (["check", "--shape", "1,2,3"], "expected four positive extents B,C,H,W"),
    (["info", "--no-such-option"], "unrecognized arguments: --no-such-option"),
])
@pytest.mark.mpi_job
def test_command_line_errors_print_once(world, args, message):
    status, stderr = _run_cli(world, args)
    assert status == 2, stderr
    assert stderr.count(message) == 1, stderr


def test_15_local_pads_of_uneven_shards(manager, world):
    """Found by tests/test_divergence.py: uneven latitudes made a longitude pad raise on every rank."""
    x = np.arange((5 + world.rank) * 4, dtype=np.float64).reshape(5 + world.rank, 4)
    for _ in range(2):  # the second call finds the plan by its quick key
        padded = halo_exchange(x, 1, dim=-1, periodic=True)
        assert np.array_equal(padded, np.pad(x, ((0, 0), (1, 1)), mode="wrap"))
    with mpidomain.HaloPlan(x, 2, dim=-1) as plan:
        assert np.array_equal(plan.pad(x), np.pad(x, ((0, 0), (2, 2))))


@pytest.mark.parametrize("make", [lambda x: x.to_sparse(), lambda x: torch.empty(4, 3, device="meta")],
                         ids=["sparse", "meta"])
def test_16_sparse_and_meta_tensors_raise_on_every_rank(manager, world, make):
    """Found by tests/test_divergence.py: they described themselves as dense CPU tensors, then failed alone."""
    x = torch.ones(4, 3)
    odd = make(x) if world.rank == world.size - 1 else x
    for call in (lambda a: halo_exchange(a, 1, dim=0), lambda a: gather_tensor(a, dim=0), allreduce):
        with pytest.raises(TypeError, match="expected a dense \\(strided\\) Torch tensor|on the meta device"):
            call(odd)

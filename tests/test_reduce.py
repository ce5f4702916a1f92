"""allreduce over the domain and data-parallel groups, its errors, and its gradients across ranks."""

import numpy as np
import pytest

from mpidomain import DomainParallelManager, allreduce, devices
from mpidomain.reduce import group_communicator
from mpitest import nth_divisor

REFERENCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}


def _value(rank, shape=(3, 4), dtype="float64"):
    """Rank ``rank``'s input: known to every rank, so each can compute the reduction itself."""
    return (np.random.default_rng(rank).standard_normal(shape) + 1.5).astype(dtype)


def _members(m, group):
    return m.domain_group_ranks() if group == "domain" else m.data_parallel_group_ranks()


@pytest.mark.parametrize("group", ["domain", "data_parallel"])
@pytest.mark.parametrize("d_index", range(3))
def test_matches_local_reduction(world, d_index, group):
    with DomainParallelManager(world.size, nth_divisor(world.size, d_index)) as m:
        stacked = np.stack([_value(r) for r in _members(m, group)])
        for op, reference in REFERENCE.items():
            result = allreduce(_value(world.rank), op, group, m)
            np.testing.assert_allclose(result, reference(stacked, axis=0), rtol=1e-12)
        counts = allreduce(np.arange(5, dtype=np.int32), "sum", group, m)
        assert counts.dtype == np.int32 and np.array_equal(counts, np.arange(5) * len(stacked))


def test_torch_dtypes_and_communicators(world):
    torch = pytest.importorskip("torch")
    stacked = np.stack([_value(r) for r in range(world.size)])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        x = torch.from_numpy(_value(world.rank)).to(dtype)
        result = allreduce(x, "mean", world)
        assert result.dtype == dtype and result.shape == x.shape
        expected = torch.from_numpy(stacked).to(dtype).float().mean(0).to(dtype)  # halves reduce in float32
        assert torch.allclose(result.float(), expected.float(), rtol=1e-6 if dtype in (torch.float32, torch.float64) else 1e-2)
    scalar = allreduce(np.array(world.rank), "sum", world)
    assert scalar == world.size * (world.size - 1) // 2


def test_device_paths_on_host_memory(world, fake_device_path):
    """The device code paths, run on CPU tensors posing as device arrays."""
    torch = pytest.importorskip("torch")
    stacked = torch.from_numpy(np.stack([_value(r) for r in range(world.size)]))
    x = torch.from_numpy(_value(world.rank))
    assert torch.allclose(allreduce(x, "sum", world), stacked.sum(0))
    assert torch.equal(allreduce(x, "max", world), stacked.amax(0))


def test_no_manager(world, fresh_manager):
    x = np.ones(3)
    if world.size == 1:
        assert allreduce(x) is x and allreduce(x, "mean", "data_parallel") is x
        assert group_communicator("domain") is None
    else:
        with pytest.raises(RuntimeError, match="needs a domain-parallel manager.*initialize_domain_parallel"):
            allreduce(x)
    assert np.array_equal(allreduce(x, "sum", world), x * world.size)


def test_errors(world):
    with DomainParallelManager(world.size, 1) as m:
        with pytest.raises(ValueError, match=r"op must be one of \('sum', 'mean', 'max', 'min', 'prod'\), got 'avg'"):
            allreduce(np.ones(3), "avg", "domain", m)
        with pytest.raises(ValueError, match=r"group must be one of \('domain', 'tensor_parallel', 'data_parallel'\) or an mpi4py communicator, got 'dp'"):
            allreduce(np.ones(3), "sum", "dp", m)
        with pytest.raises(TypeError, match="group must be one of .* or an mpi4py intracommunicator, got int"):
            allreduce(np.ones(3), "sum", 3, m)
        with pytest.raises(TypeError, match="op='mean' cannot reduce int64 values"):
            allreduce(np.ones(3, np.int64), "mean", world)
        with pytest.raises(TypeError, match="op='sum' cannot reduce bool values"):
            allreduce(np.ones(3, bool), "sum", world)
    m.close()
    with pytest.raises(RuntimeError, match="is closed"):
        allreduce(np.ones(3), "sum", "domain", m)


def test_disagreement_raises_everywhere(world):
    if world.size == 1:
        pytest.skip("needs two or more ranks")
    torch = pytest.importorskip("torch")
    shape = (3, 4) if world.rank else (4, 3)
    with pytest.raises(ValueError, match=r"same op, shape, dtype and requires_grad on every rank, got rank 0: op='sum' shape \(4, 3\) float64"):
        allreduce(np.zeros(shape), "sum", world)
    with pytest.raises(ValueError, match=r"rank 1: op='max'"):
        allreduce(np.zeros(3), "sum" if world.rank != 1 else "max", world)
    with pytest.raises(ValueError, match="requiring grad"):
        allreduce(torch.zeros(3, requires_grad=world.rank == 0), "sum", world)
    with pytest.raises(NotImplementedError, match="op='prod'\\) is not differentiable"):
        allreduce(torch.ones(3, requires_grad=True), "prod", world)
    assert allreduce(np.ones(2), "sum", world).tolist() == [world.size] * 2  # still in step


@pytest.mark.parametrize("op", ["sum", "mean"])
def test_gradcheck_across_ranks(world, op):
    torch = pytest.importorskip("torch")
    with DomainParallelManager(world.size, world.size) as m:
        x = torch.from_numpy(_value(world.rank, (2, 3))).requires_grad_()
        # Every rank runs gradcheck in step (same number of forward and backward calls).
        assert torch.autograd.gradcheck(lambda t: allreduce(t, op, "domain", m), (x,))


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_gradient_matches_single_process(world, op):
    """Backward across ranks equals the gradient of the same global function computed on one process."""
    torch = pytest.importorskip("torch")
    inputs = [torch.from_numpy(_value(r, (5,))) for r in range(world.size)]
    inputs[0][1] = inputs[-1][1] = 9.0  # a tie for max: the gradient splits between the holders
    weights = [torch.from_numpy(_value(100 + r, (5,))) for r in range(world.size)]
    x = inputs[world.rank].clone().requires_grad_()
    (allreduce(x, op, world) * weights[world.rank]).sum().backward()
    everyone = [t.clone().requires_grad_() for t in inputs]
    stacked = torch.stack(everyone)
    reduced = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
    sum((reduced * w).sum() for w in weights).backward()
    assert torch.allclose(x.grad, everyone[world.rank].grad, rtol=1e-12)


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_cuda_tensors(world, monkeypatch, cuda_aware):
    torch = pytest.importorskip("torch")
    if not world.allreduce(bool(torch.cuda.is_available())) == world.size:
        pytest.skip("needs a CUDA device on every rank")
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", "1" if cuda_aware else "0")
    devices.cuda_aware_decision(refresh=True)
    try:
        if devices.cuda_aware_decision().conflict:  # forced direct on an MPI without CUDA support: refused
            with pytest.raises(RuntimeError, match="MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI"):
                allreduce(torch.ones(3, 4, dtype=torch.float64).cuda(), "sum", world)
            return
        stacked = torch.from_numpy(np.stack([_value(r) for r in range(world.size)]))
        x = torch.from_numpy(_value(world.rank)).cuda().requires_grad_()
        y = allreduce(x, "sum", world)
        assert y.is_cuda and torch.allclose(y.cpu(), stacked.sum(0))
        y.sum().backward()
        assert torch.allclose(x.grad.cpu(), torch.full((3, 4), float(world.size), dtype=torch.float64))
    finally:
        monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
        devices.cuda_aware_decision(refresh=True)


def test_agree(world):
    from mpidomain._agreement import agree

    assert agree(world, "f", ("sum", (3, 4), "float32"), flag=world.rank == world.size - 1)
    assert not agree(world, "f", ("sum", (3, 4), "float32"))
    if world.size > 1:  # a rank in another call: named, on every rank
        with pytest.raises(ValueError, match=r"f needs the same arguments on every rank, got rank 0: True"):
            agree(world, "f", world.rank == 0)
        with pytest.raises(RuntimeError, match=r"different mpidomain calls \(rank 0: g, rank 1: f"):
            agree(world, "g" if world.rank == 0 else "f", None)
    error = TypeError("bad x on the last rank") if world.rank == world.size - 1 else None
    with pytest.raises(TypeError, match="bad x on the last rank"):
        agree(world, "f", None, error=error)

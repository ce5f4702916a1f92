"""allreduce_gradients against the mean of every replica's gradient computed on one process."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidomain import DomainParallelManager, devices
from mpitest import nth_divisor

torch = pytest.importorskip("torch")
from mpidomain.nn import allreduce_gradients  # noqa: E402  (needs torch)


def _model():
    """A small model; parameter order: frozen, unused, 0.weight, 0.bias, 2.weight, 2.bias."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # never has a gradient
    model.unused = torch.nn.Parameter(torch.ones(4))                       # gradient stays None
    return model.double()


def _gradients(replica):
    """The gradients of replica ``replica`` (its own data), computed here."""
    model = _model()
    data = torch.from_numpy(np.random.default_rng(replica).standard_normal((5, 6)))
    model(data).pow(2).sum().backward()
    return model, [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("bucket_bytes", [1, 200, 25 * 2**20])
@pytest.mark.parametrize("d_index", range(3))
def test_data_parallel_mean_equals_mean_of_replicas(world, d_index, bucket_bytes):
    with DomainParallelManager(world.size, nth_divisor(world.size, d_index)) as m:
        replicas = [1000 * m.domain_rank + q for q in range(m.dp_world_size)]  # one data set per dp rank
        model, _ = _gradients(replicas[m.dp_rank])
        buckets = allreduce_gradients(model, manager=m, bucket_bytes=bucket_bytes)
        assert buckets == (0 if m.dp_world_size == 1 else {1: 4, 200: 3, 25 * 2**20: 1}[bucket_bytes])
        everyone = [_gradients(q)[1] for q in replicas]
        for index, param in enumerate(model.parameters()):
            if everyone[0][index] is None:
                assert param.grad is None
                continue
            expected = torch.stack([grads[index] for grads in everyone]).mean(0)
            assert torch.allclose(param.grad, expected, rtol=1e-12, atol=1e-14), index


def test_sum_over_domain_and_communicators(world):
    with DomainParallelManager(world.size, world.size) as m:
        model, _ = _gradients(world.rank)
        allreduce_gradients(model.parameters(), group="domain", op="sum", manager=m)
        everyone = [_gradients(r)[1] for r in range(world.size)]
        for index, param in enumerate(model.parameters()):
            if param.grad is not None:
                assert torch.allclose(param.grad, sum(g[index] for g in everyone), rtol=1e-12)
    model, _ = _gradients(world.rank)
    allreduce_gradients(list(model.parameters()) * 2, group=world)  # duplicates count once
    expected = torch.stack([_gradients(r)[1][2] for r in range(world.size)]).mean(0)
    assert torch.allclose(model[0].weight.grad, expected, rtol=1e-12)


def test_half_precision_reduces_in_float32(world):
    grads = [torch.from_numpy(np.random.default_rng(r).standard_normal(7)).to(torch.bfloat16) for r in range(world.size)]
    param = torch.nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))
    param.grad = grads[world.rank].clone()
    allreduce_gradients([param], group=world)
    assert param.grad.dtype == torch.bfloat16
    assert torch.allclose(param.grad.float(), torch.stack(grads).float().mean(0), rtol=1e-2)


def test_device_paths_on_host_memory(world, fake_device_path):
    """The device code paths, run on CPU tensors posing as device arrays."""
    model, _ = _gradients(world.rank)
    allreduce_gradients(model, group=world, bucket_bytes=100)
    everyone = [_gradients(r)[1] for r in range(world.size)]
    for index, param in enumerate(model.parameters()):
        if param.grad is not None:
            assert torch.allclose(param.grad, torch.stack([g[index] for g in everyone]).mean(0), rtol=1e-12)


def test_no_manager(world, fresh_manager):
    model, grads = _gradients(0)
    if world.size > 1:
        with pytest.raises(RuntimeError, match="needs a domain-parallel manager"):
            allreduce_gradients(model)
        return
    assert allreduce_gradients(model) == 0
    assert all(g is None or torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_errors(world):
    model, _ = _gradients(0)
    with pytest.raises(ValueError, match="op must be 'mean' or 'sum', got 'max'"):
        allreduce_gradients(model, group=world, op="max")
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int, got 0"):
        allreduce_gradients(model, group=world, bucket_bytes=0)
    with pytest.raises(TypeError, match="an iterable of tensors, found a str"):
        allreduce_gradients(["w"], group=world)
    with pytest.raises(ValueError, match="group must be one of"):
        allreduce_gradients(model, group="world")


def test_disagreeing_gradients_raise_everywhere(world):
    if world.size == 1:
        pytest.skip("needs two or more ranks")
    model, _ = _gradients(world.rank)
    if world.rank == 1:
        model[0].bias.grad = None  # one rank skipped a parameter the others have
    with pytest.raises(ValueError, match=r"rank 1: op='mean' bucket_bytes=\d+, 3 of 6 parameters with a gradient \(2,4-5\)"):
        allreduce_gradients(model, group=world)
    param = torch.nn.Parameter(torch.zeros(4 if world.rank == 0 else 3))
    param.grad = torch.ones_like(param)
    with pytest.raises(ValueError, match=r"parameter 0: shape \(4,\) torch.float32 on cpu on rank\(s\) 0; "
                                         r"shape \(3,\) torch.float32 on cpu on rank\(s\) 1"):
        allreduce_gradients([param], group=world)
    model, _ = _gradients(world.rank)
    assert allreduce_gradients(model, group=world) == 1  # the group is still in step
    assert MPI.COMM_WORLD.allreduce(1) == world.size


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_cuda_gradients(world, monkeypatch, cuda_aware):
    if not world.allreduce(bool(torch.cuda.is_available())) == world.size:
        pytest.skip("needs a CUDA device on every rank")
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", "1" if cuda_aware else "0")
    devices.cuda_aware_decision(refresh=True)
    try:
        if world.size > 1 and devices.cuda_aware_decision().conflict:  # forced direct, MPI without CUDA: refused
            model = _gradients(world.rank)[0].cuda()
            with pytest.raises(RuntimeError, match="MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI"):
                allreduce_gradients(model, group=world, bucket_bytes=200)
            return
        model, _ = _gradients(world.rank)
        model.cuda()
        allreduce_gradients(model, group=world, bucket_bytes=200)
        everyone = [_gradients(r)[1] for r in range(world.size)]
        for index, param in enumerate(model.parameters()):
            if param.grad is not None:
                assert param.grad.is_cuda
                assert torch.allclose(param.grad.cpu(), torch.stack([g[index] for g in everyone]).mean(0), rtol=1e-12)
    finally:
        monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
        devices.cuda_aware_decision(refresh=True)

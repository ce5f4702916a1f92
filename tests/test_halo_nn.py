"""mpidomain.nn.HaloExchange: forward against the global reference, backward against the global
adjoint, gradcheck of the whole domain-parallel function in float64, and a sharded convolution."""

import numpy as np
import pytest
from mpi4py import MPI

from mpidomain import DomainParallelManager
from mpitest import divisors
from reference import bounds as shard_bounds
from reference import padded_rows
from test_halo import all_cases, global_field

torch = pytest.importorskip("torch")
from mpidomain.nn import HaloExchange  # noqa: E402  (needs torch)


class _Replicate(torch.autograd.Function):
    """Identity on a tensor every rank holds the same copy of; backward sums the ranks' gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        total = grad.detach().contiguous().numpy().copy()
        ctx.comm.Allreduce(MPI.IN_PLACE, total)
        return torch.from_numpy(total), None


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along ``dim``; backward hands each rank its own part."""

    @staticmethod
    def forward(ctx, y, comm, dim):
        pieces = comm.allgather(y.detach().numpy())
        ctx.span = (dim, sum(p.shape[dim] for p in pieces[:comm.rank]), y.shape[dim])
        return torch.from_numpy(np.concatenate(pieces, axis=dim))

    @staticmethod
    def backward(ctx, grad):
        dim, start, length = ctx.span
        return grad.narrow(dim, start, length).clone(), None, None


def shard(field, manager, dim):
    extent = field.shape[dim]
    start, n = shard_bounds(extent, manager.domain_parallel_size, manager.domain_rank)
    return field.narrow(dim, start, n), start, n


def test_forward_and_backward_match_the_global_adjoint(world):
    check_against_the_global_adjoint(world)


def test_device_paths_match_the_global_adjoint(world, fake_device_path):
    check_against_the_global_adjoint(world)  # the GPU paths (staged, CUDA-aware), on host memory


def check_against_the_global_adjoint(world):
    for d, h, periodic, uneven in all_cases(world):
        with DomainParallelManager(world.size, d) as manager:
            extent = 3 * d + (d - 1 if uneven else 0)
            field = torch.from_numpy(global_field((2, 2, "N", 3), extent, seed=7 + manager.mesh.group_index("domain"), dtype=np.float64))
            x, start, n = shard(field, manager, -2)
            x = x.clone().requires_grad_(True)
            out = HaloExchange(h, dim=-2, periodic=periodic, manager=manager)(x)
            assert torch.equal(out.detach(), torch.from_numpy(padded_rows(field.numpy(), -2, h, periodic, start, n)))
            # Every rank's output gradient, known globally: the same seeds on every rank.
            grads = [torch.from_numpy(np.random.default_rng(100 * manager.mesh.group_index("domain") + r).standard_normal(
                (2, 2, shard_bounds(extent, d, r)[1] + 2 * h, 3))) for r in range(d)]
            out.backward(grads[manager.domain_rank])
            # Global adjoint: pad the whole field with autograd and slice every rank's window.
            whole = field.clone().requires_grad_(True)
            before = whole[:, :, extent - h:] if periodic else torch.zeros(2, 2, h, 3, dtype=torch.float64)
            after = whole[:, :, :h] if periodic else torch.zeros(2, 2, h, 3, dtype=torch.float64)
            padded = torch.cat([before, whole, after], dim=-2)
            loss = sum((padded[:, :, s:s + m + 2 * h] * g).sum()
                       for g, (s, m) in zip(grads, (shard_bounds(extent, d, r) for r in range(d))))
            loss.backward()
            torch.testing.assert_close(x.grad, whole.grad[:, :, start:start + n], rtol=1e-14, atol=1e-14,
                                       msg=lambda m: f"D={d} h={h} periodic={periodic} uneven={uneven}: {m}")


@pytest.mark.parametrize("periodic", [False, True])
def test_gradcheck_across_ranks(world, periodic):
    """gradcheck of X -> every rank's padded shard, gathered: the same function on every rank."""
    for d in divisors(world.size):
        with DomainParallelManager(world.size, d) as manager:
            comm = manager.domain_comm
            extent = 2 * d + (1 if d > 1 else 0)  # uneven when D > 1
            exchange = HaloExchange(2 if d == 1 else 1, dim=2, periodic=periodic, manager=manager)

            def domain_parallel(field):
                local, _, _ = shard(_Replicate.apply(field, comm), manager, 2)
                return _AllGather.apply(exchange(local), comm, 2)

            field = torch.from_numpy(global_field((1, 2, "N", 2), extent, seed=3 + manager.mesh.group_index("domain"),
                                                  dtype=np.float64)).requires_grad_(True)
            assert torch.autograd.gradcheck(domain_parallel, (field,), eps=1e-6, atol=1e-9)


def test_trim_is_credits():
    x = torch.arange(2 * 3 * 8 * 4).reshape(2, 3, 8, 4)
    assert torch.equal(HaloExchange.trim(x, 1, 2), x[:, :, 1:6])
    assert torch.equal(HaloExchange.trim(x, 0, 0, dim=-1), x)
    assert torch.equal(HaloExchange.trim(x, 1, 1, dim=1), x[:, 1:2])
    assert repr(HaloExchange(2, dim=-1, periodic=True)) == "HaloExchange(halo_width=2, dim=-1, periodic=True)"


def test_sharded_convolution_equals_the_global_one(world):
    """A 3x3 convolution on latitude shards with halo 1 gives the global convolution's rows and gradients."""
    d = world.size
    with DomainParallelManager(world.size, d) as manager:
        extent = 4 * d + d // 2
        field = torch.from_numpy(global_field((2, 3, "N", 6), extent, seed=11 + manager.mesh.group_index("domain"), dtype=np.float64))
        weight = torch.from_numpy(np.random.default_rng(5).standard_normal((4, 3, 3, 3))).requires_grad_(True)
        x, start, n = shard(field, manager, -2)
        x = x.clone().requires_grad_(True)
        local = torch.nn.functional.conv2d(HaloExchange(1, manager=manager)(x), weight, padding=(0, 1))
        whole = field.clone().requires_grad_(True)
        reference_weight = weight.detach().clone().requires_grad_(True)
        full = torch.nn.functional.conv2d(whole, reference_weight, padding=1)
        torch.testing.assert_close(local.detach(), full.detach()[:, :, start:start + n], rtol=1e-12, atol=1e-12)
        (local ** 2).sum().backward()
        (full ** 2).sum().backward()
        torch.testing.assert_close(x.grad, whole.grad[:, :, start:start + n], rtol=1e-12, atol=1e-12)
        weight_grad = weight.grad.numpy().copy()
        manager.domain_comm.Allreduce(MPI.IN_PLACE, weight_grad)
        torch.testing.assert_close(torch.from_numpy(weight_grad), reference_weight.grad, rtol=1e-10, atol=1e-10)

"""Domain-parallel layers against their single-process twins: forward, input gradient, parameter gradients.

Every rank builds the same layer and the same global field (float64, fixed
seeds), runs the layer on the whole field, and its domain-parallel twin on
its shard (even and uneven shards). The outputs gathered across ranks, each
rank's input-gradient rows and the parameter gradients summed over the
domain group (``allreduce_gradients(..., op="sum")``) must equal the
single-process ones to 1e-10 relative. Mismatches are collected and asserted
once per test, so a failing rank never leaves the others in a collective.
"""

import copy

import pytest

torch = pytest.importorskip("torch")

import mpidomain  # noqa: E402
from mpidomain import DomainParallelManager, gather_tensor  # noqa: E402
from mpidomain.nn import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,  # noqa: E402
                          DomainParallelConvTranspose3d, DomainParallelGroupNorm, DomainParallelInterpolate,
                          DomainParallelPeriodicConv2d, allreduce_gradients)

nn = torch.nn
TOLERANCE = 1e-10


@pytest.fixture
def manager(world):
    with DomainParallelManager(world.size, world.size) as m:
        yield m


def counts_for(total, parts):
    counts, _ = mpidomain.balanced_split(total, parts)
    return list(counts)


def relative_error(got, want):
    scale = max(float(want.abs().max()), 1e-300)
    return float((got - want).abs().max()) / scale


def compare(manager, single, parallel, shape, counts, dim=-2, seed=0):
    """Return the problems found comparing ``parallel`` on shards of ``counts`` rows with ``single``."""
    D, rank = manager.domain_parallel_size, manager.domain_rank
    generator = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, dtype=torch.float64, generator=generator)
    full_in = full.clone().requires_grad_()
    reference = single(full_in)
    weights = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
    (reference * weights).sum().backward()
    start = sum(counts[:rank])
    local_in = full.narrow(dim, start, counts[rank]).clone().requires_grad_()
    out = parallel(local_in)
    problems = []
    rows = manager.domain_comm.allgather(out.shape[dim])
    first = sum(rows[:rank])
    whole = gather_tensor(out.detach(), dim=dim, manager=manager) if D > 1 else out.detach()
    if whole.shape != reference.shape:
        problems.append(f"output shape {tuple(whole.shape)} != {tuple(reference.shape)} (rows per rank {rows})")
        return problems
    error = relative_error(whole, reference.detach())
    if error > TOLERANCE:
        problems.append(f"forward relative error {error:.3g}")
    (out * weights.narrow(dim, first, rows[rank])).sum().backward()
    error = relative_error(local_in.grad, full_in.grad.narrow(dim, start, counts[rank]))
    if error > TOLERANCE:
        problems.append(f"input gradient relative error {error:.3g} on rank {manager.rank}")
    if any(p.grad is None for p in parallel.parameters()):
        for p in parallel.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    allreduce_gradients(parallel, group="domain", op="sum", manager=manager)
    for (name, p), q in zip(parallel.named_parameters(), single.parameters()):
        if q.grad is None:
            continue
        error = relative_error(p.grad, q.grad)
        if error > TOLERANCE:
            problems.append(f"gradient of {name} relative error {error:.3g}")
    return problems


def run_cases(manager, cases, make_parallel, shape_of, dims=(-2,)):
    problems = []
    D = manager.domain_parallel_size
    for label, make in cases:
        for uneven in (False, True):
            torch.manual_seed(1)
            single = make().double()
            parallel = make_parallel(copy.deepcopy(single))
            shape = shape_of(D, uneven)
            counts = counts_for(shape[-2], D)
            try:
                found = compare(manager, single, parallel, shape, counts)
            except Exception as error:  # every rank raises alike (collective errors), so this stays in step
                found = [f"raised {type(error).__name__}: {error}"]
            problems += [f"{label} ({'uneven' if uneven else 'even'} {counts}): {p}" for p in found]
    return problems


def shape_2d(D, uneven):
    return (2, 3, 8 * D + (3 if uneven else 0), 10)


CONVS = [
    ("3x3 padding 1", lambda: nn.Conv2d(3, 4, 3, padding=1)),
    ("kernel 4 stride 2 padding 1", lambda: nn.Conv2d(3, 4, 4, stride=2, padding=1)),
    ("kernel 3 stride 2 padding 1", lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1)),
    ("5x3 padding (2, 1)", lambda: nn.Conv2d(3, 4, (5, 3), padding=(2, 1))),
    ("dilation 2", lambda: nn.Conv2d(3, 4, 3, padding=2, dilation=2)),
    ("valid", lambda: nn.Conv2d(3, 4, 3, padding=0)),
    ("same, kernel 4", lambda: nn.Conv2d(3, 4, 4, padding="same")),
    ("1x1 stride 2", lambda: nn.Conv2d(3, 4, 1, stride=2)),
    ("groups 3 no bias", lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3, bias=False)),
    ("circular", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")),
    ("reflect", lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")),
    ("replicate", lambda: nn.Conv2d(3, 4, 3, padding=(2, 1), padding_mode="replicate")),
]


def test_conv2d(manager):
    problems = run_cases(manager, CONVS, lambda m: DomainParallelConv2d(m, manager=manager), shape_2d)
    assert not problems, "\n".join(problems)


TRANSPOSED = [
    ("kernel 4 stride 2 padding 1", lambda: nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1)),
    ("kernel 2 stride 2", lambda: nn.ConvTranspose2d(3, 4, 2, stride=2)),
    ("kernel 3 stride 2 padding 1 output_padding 1", lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1,
                                                                                output_padding=1)),
    ("kernel 1 stride 2", lambda: nn.ConvTranspose2d(3, 4, 1, stride=2)),
    ("kernel 3 dilation 2 padding 2", lambda: nn.ConvTranspose2d(3, 4, 3, padding=2, dilation=2)),
    ("5x3 stride (2, 1)", lambda: nn.ConvTranspose2d(3, 4, (5, 3), stride=(2, 1), padding=(1, 1))),
]


def test_conv_transpose2d(manager):
    problems = run_cases(manager, TRANSPOSED, lambda m: DomainParallelConvTranspose2d(m, manager=manager), shape_2d)
    assert not problems, "\n".join(problems)


def shape_3d(D, uneven):
    return (1, 2, 4, 8 * D + (3 if uneven else 0), 6)


def test_3d(manager):
    convs = [("3x3x3 padding 1", lambda: nn.Conv3d(2, 3, 3, padding=1)),
             ("stride (1, 2, 2)", lambda: nn.Conv3d(2, 3, (3, 4, 4), stride=(1, 2, 2), padding=1))]
    problems = run_cases(manager, convs, lambda m: DomainParallelConv3d(m, manager=manager), shape_3d)
    transposed = [("kernel (2, 4, 4) stride 2 padding (0, 1, 1)",
                   lambda: nn.ConvTranspose3d(2, 3, (2, 4, 4), stride=2, padding=(0, 1, 1)))]
    problems += run_cases(manager, transposed, lambda m: DomainParallelConvTranspose3d(m, manager=manager), shape_3d)
    assert not problems, "\n".join(problems)


class PeriodicTwin(nn.Module):
    """Single-process periodic convolution: circular in longitude, zeros in latitude."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=(1, 2), dilation=(1, 2))

    def forward(self, x):
        x = torch.nn.functional.pad(x, (2, 2, 0, 0), mode="circular")
        x = torch.nn.functional.pad(x, (0, 0, 1, 1))
        c = self.conv
        return torch.nn.functional.conv2d(x, c.weight, c.bias, c.stride, 0, c.dilation)


def test_periodic_conv2d(manager):
    problems = run_cases(manager, [("periodic", PeriodicTwin)],
                         lambda m: DomainParallelPeriodicConv2d(m.conv, manager=manager), shape_2d)
    assert not problems, "\n".join(problems)


def test_group_norm(manager):
    norms = [("1 group", lambda: nn.GroupNorm(1, 4)), ("C groups", lambda: nn.GroupNorm(4, 4)),
             ("2 groups, no affine", lambda: nn.GroupNorm(2, 4, affine=False))]
    problems = run_cases(manager, norms, lambda m: DomainParallelGroupNorm(m, manager=manager),
                         lambda D, uneven: (2, 4, 8 * D + (3 if uneven else 0), 10))
    assert not problems, "\n".join(problems)


class Resample(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return torch.nn.functional.interpolate(x, **self.kwargs)


INTERPOLATIONS = [
    dict(scale_factor=2, mode="bilinear"),
    dict(scale_factor=2, mode="nearest"),
    dict(scale_factor=2, mode="bilinear", align_corners=True),
    dict(size=(13, 7), mode="bilinear"),
    dict(size=(29, 21), mode="nearest"),
    dict(scale_factor=0.5, mode="bilinear"),
    dict(size=(17, 12), mode="bicubic"),
]


def test_interpolate(manager):
    cases = [(str(kw), lambda kw=kw: Resample(**kw)) for kw in INTERPOLATIONS]
    problems = run_cases(manager, cases, lambda m: DomainParallelInterpolate(**m.kwargs, manager=manager),
                         lambda D, uneven: (2, 3, 8 * D + (3 if uneven else 0), 10))
    assert not problems, "\n".join(problems)


def test_a_layer_along_an_unsharded_dim_is_local_on_uneven_shards(manager):
    """Longitude is not sharded: the layer is the plain convolution of this rank's rows, whatever their count."""
    torch.manual_seed(2)
    conv = nn.Conv2d(2, 3, (1, 3), padding=(0, 1), padding_mode="circular").double()
    layer = DomainParallelConv2d(copy.deepcopy(conv), shard_dim=-1, manager=manager)
    x = torch.randn(1, 2, 3 + manager.domain_rank, 8, dtype=torch.float64)
    assert torch.allclose(layer(x), conv(x), rtol=1e-12, atol=0)

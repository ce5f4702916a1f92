"""Overlapped halo exchange in convolutions and pools: the same results as exchange-then-compute.

Each layer runs twice on the same shard or tile (float64), once with ``overlap=True`` (halos started,
interior rows computed, then the edge rows; backward the same in reverse) and once with
``overlap=False``: the outputs, the input gradients and each rank's own parameter gradients (before
any all-reduce) must agree to 1e-12 relative. (On CPU float64 convolutions of different heights may
sum in another order inside MKL's GEMM, so bitwise equality is not asserted; float32 and pools are
bitwise here.) Against one process the layers are checked by the layer suites, which run with either
setting (``MPIDOMAIN_OVERLAP=1``).
"""

import copy

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.nn import (DomainParallelAvgPool2d, DomainParallelConv2d, DomainParallelConv3d,  # noqa: E402
                          DomainParallelMaxPool2d, DomainParallelPeriodicConv2d, overlap_default, set_overlap)
from mpidomain.nn import overlap as overlap_module  # noqa: E402
from reference import tile_of  # noqa: E402

nn = torch.nn
TOLERANCE = 1e-12


def layouts(size):
    """Slabs of every rank, and every 2-D tiling with both dims split (2 x 2 at 4 ranks)."""
    found = [(size, -2)]
    found += [((a, size // a), (-2, -1)) for a in range(2, size) if size % a == 0]
    return found


def relative(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def run(layer, x, weights_seed=3):
    x = x.clone().requires_grad_()
    out = layer(x)
    generator = torch.Generator().manual_seed(weights_seed)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=generator)
    (out * weights).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
    return out.detach(), x.grad, grads


def differences(make, wrap, manager, shard_dim, shape, seed=0):
    """Problems of ``wrap(make(), overlap=True)`` against ``overlap=False`` on this rank's tile of a random field."""
    torch.manual_seed(1)
    module = make().double()
    on = wrap(copy.deepcopy(module), shard_dim, manager, overlap=True)
    off = wrap(copy.deepcopy(module), shard_dim, manager, overlap=False)
    full = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    x = tile_of(full, manager).contiguous()
    got, want = run(on, x), run(off, x)
    problems = []
    if got[0].shape != want[0].shape:
        return [f"output shape {tuple(got[0].shape)} != {tuple(want[0].shape)}"]
    for what, a, b in [("output", got[0], want[0]), ("input gradient", got[1], want[1])] + [
            (f"gradient {i}", a, b) for i, (a, b) in enumerate(zip(got[2], want[2])) if b is not None]:
        error = relative(a, b)
        if error > TOLERANCE:
            problems.append(f"{what}: relative difference {error:.3g} on rank {manager.rank}")
    return problems


def conv(make):
    return make, lambda m, shard_dim, manager, overlap: DomainParallelConv2d(m, shard_dim, manager, overlap=overlap)


def pool(make, kind):
    return make, lambda m, shard_dim, manager, overlap: kind(m, shard_dim, manager, overlap=overlap)


def periodic(latitude):
    return (lambda: nn.Conv2d(3, 4, 3, padding=1),
            lambda m, shard_dim, manager, overlap: DomainParallelPeriodicConv2d(m, shard_dim, manager,
                                                                                latitude=latitude, overlap=overlap))


CASES = {
    "conv k3": conv(lambda: nn.Conv2d(3, 4, 3, padding=1)),
    "conv k5": conv(lambda: nn.Conv2d(3, 4, 5, padding=2)),
    "conv k3 stride 2": conv(lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1)),
    "conv k4 stride 2": conv(lambda: nn.Conv2d(3, 4, 4, stride=2, padding=1)),
    "conv k5 stride 2 dilation 2": conv(lambda: nn.Conv2d(3, 4, 5, stride=2, padding=3, dilation=2)),
    "conv k3 valid": conv(lambda: nn.Conv2d(3, 4, 3)),
    "conv k5 circular": conv(lambda: nn.Conv2d(3, 4, 5, padding=2, padding_mode="circular")),
    "conv k3 reflect": conv(lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")),
    "conv (5, 3) replicate": conv(lambda: nn.Conv2d(3, 4, (5, 3), padding=(2, 1), padding_mode="replicate")),
    "conv k3 groups, no bias": conv(lambda: nn.Conv2d(3, 6, 3, padding=1, groups=3, bias=False)),
    "periodic longitude": periodic("zeros"),
    "periodic longitude, reflect latitude": periodic("reflect"),
    "max pool k3 s2 p1": pool(lambda: nn.MaxPool2d(3, 2, 1), DomainParallelMaxPool2d),
    "max pool k2 ceil": pool(lambda: nn.MaxPool2d(2, ceil_mode=True), DomainParallelMaxPool2d),
    "avg pool k3 s1 p1": pool(lambda: nn.AvgPool2d(3, 1, 1, count_include_pad=False), DomainParallelAvgPool2d),
    "avg pool k3 s2 ceil": pool(lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True), DomainParallelAvgPool2d),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_overlap_equals_exchange_then_compute(world, name):
    """Forward, input and parameter gradients with overlap equal those without, on slabs and tiles, even and
    uneven extents."""
    make, wrap = CASES[name]
    problems = []
    for shape, shard_dim in layouts(world.size):
        with DomainParallelManager(world.size, shape, shard_dim) as manager:
            lat = shape if isinstance(shape, int) else shape[0]
            for field in ((2, 3, 12 * lat, 18), (2, 3, 12 * lat + 5, 23)):
                try:
                    found = differences(make, wrap, manager, shard_dim, field)
                except Exception as error:  # collective errors raise alike on every rank
                    found = [f"raised {type(error).__name__}: {error}"]
                problems += [f"{shape} {field}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_conv3d_overlap(world):
    """A Conv3d on (B, C, T, H, W), latitude slabs."""
    problems = []
    with DomainParallelManager(world.size, world.size) as manager:
        def wrap(m, shard_dim, manager, overlap):
            return DomainParallelConv3d(m, shard_dim, manager, overlap=overlap)

        field = (1, 2, 3, 8 * world.size + 3, 9)
        problems = differences(lambda: nn.Conv3d(2, 3, 3, padding=1), wrap, manager, -2, field)
    assert not problems, "\n".join(problems)


def test_overlap_without_grad_and_float32(world):
    """No autograd (no_grad, an input that needs no grad) and float32: the same rows, bitwise here for float32."""
    with DomainParallelManager(world.size, world.size) as manager:
        torch.manual_seed(0)
        module = nn.Conv2d(4, 4, 3, padding=1)
        on = DomainParallelConv2d(copy.deepcopy(module), manager=manager, overlap=True)
        off = DomainParallelConv2d(copy.deepcopy(module), manager=manager, overlap=False)
        x = torch.randn(2, 4, 10, 16)
        with torch.no_grad():
            a, b = on(x), off(x)
        c, d = on(x), off(x)  # weights need grad, x does not
        assert relative(a, b) <= 1e-6 and relative(c, d) <= 1e-6
        assert torch.equal(a, c)


def test_default_and_switch(monkeypatch):
    """set_overlap over MPIDOMAIN_OVERLAP over the built-in default; a layer's own setting over both."""
    monkeypatch.delenv("MPIDOMAIN_OVERLAP", raising=False)
    assert overlap_default() is overlap_module.DEFAULT
    monkeypatch.setenv("MPIDOMAIN_OVERLAP", "1")
    assert overlap_default() is True
    monkeypatch.setenv("MPIDOMAIN_OVERLAP", "0")
    assert overlap_default() is False
    try:
        set_overlap(True)
        assert overlap_default() is True and overlap_module.resolve(False) is False
    finally:
        set_overlap(None)
    assert overlap_default() is False
    monkeypatch.setenv("MPIDOMAIN_OVERLAP", "maybe")
    with pytest.raises(ValueError, match="MPIDOMAIN_OVERLAP"):
        overlap_default()
    with pytest.raises(TypeError):
        set_overlap(1)


def test_ranks_that_disagree_raise_on_every_rank(world):
    """One rank overlapping and the others not: the layer's agreement step raises on every rank (no hang)."""
    if world.size == 1:
        pytest.skip("needs several ranks")
    with DomainParallelManager(world.size, world.size) as manager:
        layer = DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1).double(), manager=manager,
                                     overlap=manager.domain_rank == 0)
        with pytest.raises((RuntimeError, ValueError)):
            layer(torch.randn(1, 2, 6, 8, dtype=torch.float64))

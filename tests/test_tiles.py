"""Halo exchange on 2-D tiles (latitude x longitude) against the padded global field.

Every rank builds the same global field, keeps its tile (``shard_tensor``),
exchanges, and compares bit for bit with the global field padded in one
piece (``np.pad``, or CREDIT's earth padding rewritten below with its torch
ops) cut to its tile and halos. The adjoint passes the dot-product test
across ranks. Every layout of the world's ranks runs in process; 3 x 2 tiles
run in a fresh 6-rank job from the serial suite.
"""

import os
import re

import numpy as np
import pytest

import mpidomain
from mpidomain import DomainParallelManager, HaloPlan, halo_exchange
from mpidomain.halo import cache as plan_cache
from mpitest import REPO, divisors, run_mpi

import reference
from reference import earth_pad, global_field

torch = pytest.importorskip("torch")
from mpidomain.nn import HaloExchange  # noqa: E402

# name: (halo_exchange's keywords, the modes along latitude and longitude; None: CREDIT's earth padding)
BOUNDARIES = {
    "zeros": (dict(periodic=False), ("zeros", "zeros")),
    "periodic-lon": (dict(periodic=(False, True)), ("zeros", "periodic")),
    "periodic-both": (dict(periodic=True), ("periodic", "periodic")),
    "earth": (dict(boundary="earth"), None),
}
# (global shape, (latitude, longitude) halo widths): even and uneven tiles, odd W, one (B, C, T, H, W)
CASES = [
    ((2, 3, 12, 16), (1, 1)),
    ((2, 3, 12, 16), (2, 1)),
    ((1, 2, 13, 17), (1, 3)),
    ((1, 2, 13, 17), (3, 2)),
    ((2, 1, 3, 13, 17), (2, 2)),
]
KINDS = [("numpy", np.float64), ("torch", np.float64), ("numpy", np.int32)]
TESTS = os.path.join(REPO, "tests")


def global_pad(field, halo, boundary, turn=True):
    """The NumPy ``field`` padded in one piece with ``halo`` = (latitude, longitude) widths."""
    modes = BOUNDARIES[boundary][1]
    if modes is None:
        return earth_pad(torch.from_numpy(field), *halo, turn=turn).numpy()
    return reference.global_pad(field, (-2, -1), halo, modes)


def window(manager, shape, halo):
    """The index of this rank's tile of a global field of ``shape``, widened by ``halo`` (in the padded field)."""
    return reference.window(manager, shape, halo, dims=(-2, -1))


def tile_of(field, manager, kind="numpy"):
    """This rank's tile of the NumPy ``field``, as ``kind``."""
    tile = np.ascontiguousarray(mpidomain.shard_tensor(field, manager=manager, allow_uneven=True))
    return torch.from_numpy(tile) if kind == "torch" else tile


def to_numpy(array):
    return array.detach().numpy() if isinstance(array, torch.Tensor) else array


def layouts(size):
    """Every (D_lat, D_lon) of ``size`` ranks."""
    return [(a, size // a) for a in divisors(size)]


def forward_problems(manager, boundary):
    """What differs, bit for bit, between each case's exchange and the global pad cut to this rank."""
    keywords = BOUNDARIES[boundary][0]
    problems = []
    for shape, halo in CASES:
        for kind, dtype in KINDS:
            field = global_field(shape, dtype=dtype)
            want = global_pad(field, halo, boundary)[window(manager, shape, halo)]
            x = tile_of(field, manager, kind)
            got = halo_exchange(x, halo, **keywords, manager=manager)
            if type(got) is not type(x) or got.dtype != x.dtype or not np.array_equal(to_numpy(got), want):
                problems.append(f"{boundary} {shape} halo {halo} {kind} {np.dtype(dtype)}: rank "
                                f"{manager.domain_rank} differs from the global pad")
    return problems


def adjoint_problems(manager, boundary):
    """Where the dot-product test fails (sum over ranks of <pad(x), y> against <x, adjoint(y)>), or autograd's
    gradient through HaloExchange differs from ``plan.adjoint``. Collective over the domain group."""
    keywords = BOUNDARIES[boundary][0]
    comm, problems = manager.domain_comm, []
    for shape, halo in CASES:
        x = tile_of(global_field(shape, seed=1), manager)
        with HaloPlan(x, halo, **keywords, manager=manager) as plan:
            y = np.random.default_rng(100 + manager.domain_rank).standard_normal(plan.padded_shape)
            adjoint = plan.adjoint(y)
            lhs = comm.allreduce(float(np.vdot(plan.pad(x), y)))
            rhs = comm.allreduce(float(np.vdot(x, adjoint)))
        if not abs(lhs - rhs) <= 1e-12 * abs(lhs):
            problems.append(f"{boundary} {shape} halo {halo}: <pad(x), y> = {lhs!r} but <x, adjoint(y)> = {rhs!r}")
        t = torch.from_numpy(x.copy()).requires_grad_()
        HaloExchange(halo, None, **keywords, manager=manager)(t).backward(torch.from_numpy(y))
        if not torch.equal(t.grad, torch.from_numpy(adjoint)):
            problems.append(f"{boundary} {shape} halo {halo}: rank {manager.domain_rank}'s autograd gradient "
                            "differs from plan.adjoint")
    return problems


def test_the_earth_reference_is_credits_padding():
    """The earth reference on CREDIT's example (H=3, W=4, x[h, w] = 10 h + w, pads (1, 1)), corners wrapped."""
    x = torch.tensor([[10 * h + w for w in range(4)] for h in range(3)]).reshape(1, 1, 3, 4)
    assert earth_pad(x, 1, 1)[0, 0].tolist() == [
        [1, 2, 3, 0, 1, 2], [3, 0, 1, 2, 3, 0], [13, 10, 11, 12, 13, 10], [23, 20, 21, 22, 23, 20],
        [21, 22, 23, 20, 21, 22]]


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
def test_forward_equals_the_padded_global_field(world, boundary):
    """Every layout of the world, case and kind: each rank's padded tile is the global pad cut to it, bit for bit."""
    problems = []
    for grid in layouts(world.size):
        with DomainParallelManager(world.size, grid, (-2, -1)) as manager:
            problems += [f"{grid}: {p}" for p in forward_problems(manager, boundary)]
    assert not problems, problems


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
def test_adjoint_passes_the_dot_product_test(world, boundary):
    """Every layout: HaloPlan.adjoint is pad's adjoint across ranks, and autograd through HaloExchange equals it."""
    problems = []
    for grid in layouts(world.size):
        with DomainParallelManager(world.size, grid, (-2, -1)) as manager:
            problems += [f"{grid}: {p}" for p in adjoint_problems(manager, boundary)]
    assert not problems, problems


def test_earth_on_latitude_slabs(world):
    """On latitude slabs (a 1-D manager), boundary="earth" is the earth pad cut to each slab, and its adjoint exact."""
    with DomainParallelManager(world.size, world.size) as manager:
        problems = forward_problems(manager, "earth") + adjoint_problems(manager, "earth")
    assert not problems, problems


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_plan_in_place_out_and_the_cache(world, kind):
    """HaloPlan.start/wait in place and halo_exchange(out=) equal halo_exchange; a second call hits the plan cache."""
    shape, halo = (1, 2, 13, 17), (2, 3)
    problems = []
    for grid in layouts(world.size):
        with DomainParallelManager(world.size, grid, (-2, -1)) as manager:
            for boundary in ("periodic-lon", "earth"):
                keywords, case = BOUNDARIES[boundary][0], f"{grid} {boundary}"
                x = tile_of(global_field(shape), manager, kind)
                expected = to_numpy(halo_exchange(x, halo, **keywords, manager=manager))
                cached = plan_cache.cached_plans(manager)
                again = halo_exchange(x, halo, **keywords, manager=manager)
                out = np.full(expected.shape, -7.0)
                out = torch.from_numpy(out) if kind == "torch" else out
                into = halo_exchange(x, halo, **keywords, manager=manager, out=out)
                now = plan_cache.cached_plans(manager)
                if len(now) != len(cached) or any(a is not b for a, b in zip(now, cached)):
                    problems.append(f"{case}: the second call built a plan ({len(cached)} -> {len(now)} cached)")
                if not np.array_equal(to_numpy(again), expected):
                    problems.append(f"{case}: the second call differs")
                if into is not out or not np.array_equal(to_numpy(out), expected):
                    problems.append(f"{case}: out= is not the result")
                with HaloPlan(x, halo, **keywords, manager=manager) as plan:
                    padded = plan.empty()
                    for step in range(2):  # stale ghosts must all be overwritten, each time
                        padded[...] = -7
                        plan.interior(padded)[...] = x
                        plan.start(padded)
                        if plan.wait() is not padded or not np.array_equal(to_numpy(padded), expected):
                            problems.append(f"{case}: start/wait in place (step {step}) differs from halo_exchange")
    assert not problems, problems


def mistakes(manager):
    """name: (this rank's x, halo_exchange's keywords, the words of the error) on a 1 x D manager."""
    size = manager.domain_parallel_size
    last = manager.domain_rank == size - 1
    x = np.zeros((1, 2, 8, 4 * size))
    thin = tile_of(np.zeros((1, 2, 8, max(1, 2 * size - 2))), manager)  # 4 ranks: tiles of 2, 2, 1, 1 columns
    return {
        "a tile thinner than its halo": (thin, dict(halo_width=(1, 2)), r"halo_width=2 along dim 3 exceeds the tile"),
        "earth along other dims": (x, dict(halo_width=1, dim=(-3, -1), boundary="earth"),
                                   r"boundary='earth' pads latitude and longitude"),
        "earth and periodic": (x, dict(halo_width=1, periodic=True, boundary="earth"), r"drop periodic="),
        "an unknown boundary": (x, dict(halo_width=1, boundary="moon"),
                                r"boundary must be None or 'earth', got 'moon'"),
        "a halo tuple of the wrong length": (x, dict(halo_width=(1, 2, 3)), r"halo_width=\(1, 2, 3\) needs one value"),
        "one rank's halo differs": (x, dict(halo_width=(2, 1) if last else (1, 1)),
                                    r"halo_width must be the same on every rank"),
    }


@pytest.mark.parametrize("call", [halo_exchange, HaloPlan], ids=["halo_exchange", "HaloPlan"])
@pytest.mark.parametrize("mistake", ["a tile thinner than its halo", "earth along other dims", "earth and periodic",
                                     "an unknown boundary", "a halo tuple of the wrong length",
                                     "one rank's halo differs"])
def test_bad_input_raises_alike_on_every_rank(world, call, mistake):
    """Each mistake raises a ValueError with the same message on every rank (none hangs or passes on some)."""
    if mistake == "one rank's halo differs" and world.size == 1:
        pytest.skip("needs two ranks to disagree")
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        x, keywords, words = mistakes(manager)[mistake]
        error = None
        try:
            call(x, **keywords, manager=manager)
        except (TypeError, ValueError) as exc:
            error = (type(exc).__name__, str(exc))
        everyone = world.allgather(error)
    assert everyone[0] is not None and everyone.count(everyone[0]) == len(everyone), everyone
    assert everyone[0][0] == "ValueError" and re.search(words, everyone[0][1]), everyone[0]


def test_a_wrong_reference_fails(world):
    """The comparison can fail: the earth pad without the half turn differs from the exchange on some layout."""
    shape, halo = CASES[2]
    field = global_field(shape)
    differs = False
    for grid in layouts(world.size):
        with DomainParallelManager(world.size, grid, (-2, -1)) as manager:
            got = halo_exchange(tile_of(field, manager), halo, boundary="earth", manager=manager)
            wrong = global_pad(field, halo, "earth", turn=False)[window(manager, shape, halo)]
            differs |= not np.array_equal(got, wrong)
    assert any(world.allgather(differs))


SIX_RANKS = r"""
import sys
sys.path.insert(0, {tests!r})
from mpi4py import MPI
import mpidomain, test_tiles
problems = []
with mpidomain.DomainParallelManager(6, (3, 2), (-2, -1)) as manager:
    for boundary in sorted(test_tiles.BOUNDARIES):
        problems += test_tiles.forward_problems(manager, boundary) + test_tiles.adjoint_problems(manager, boundary)
print(f"rank {{MPI.COMM_WORLD.rank}}: 3x2 problems {{problems}}", flush=True)
"""


@pytest.mark.mpi_job
def test_three_by_two_tiles_on_six_ranks(world):
    """3 x 2 tiles in a fresh 6-rank job: forward exact and the adjoint's dot-product test, every boundary and case."""
    if world.size != 1:
        pytest.skip("the 6-rank job runs from the serial suite (python -m pytest, mpiexec -n 1)")
    job = run_mpi(6, ["-c", SIX_RANKS.format(tests=TESTS)], timeout=300)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-3000:]
    assert job.stdout.count("3x2 problems []") == 6, job.stdout[-3000:]

"""Sharded autoregressive rollouts (issue 28, part 3): K steps on this rank's tile, trained and forecast.

A converted model steps its own tile forward K = 4 times (x_{k+1} = model(x_k)); no rank ever holds
more than its tile between steps (no gather). Float64 against the unconverted model on one process
(every rank runs it on the whole field): training (loss = sum over the steps of the whole field's
mean square error, backward through all K steps, gradients summed over the domain group), inference
(``torch.no_grad``) and the activation bytes each rank keeps for backward. The converted UNet of
:mod:`mpidomain.models` and CREDIT's CrossFormer (skipped alike on every rank where CREDIT cannot be
imported), on latitude slabs of all the world's ranks and on 2 x 2 tiles at 4.
"""

import copy
import os

import pytest

torch = pytest.importorskip("torch")

from mpitest import REPO, run_mpi, share, wait_politely  # noqa: E402
from mpidomain import DomainParallelManager, allreduce, gather_tensor, shard_tensor  # noqa: E402
from mpidomain.models import UNet, convert_model, credit_crossformer, credit_missing  # noqa: E402
from mpidomain.nn import SavedActivations, allreduce_gradients  # noqa: E402

STEPS = 4
TOLERANCE = 1e-9
# model -> (channels, rows, columns) of the exactness runs and of the memory run. The memory grids are
# larger: a convolution keeps its input with its halo rows, which at 8 rows a rank (UNet 32 x 64 at D = 4)
# or 2 rows a rank at the CrossFormer's coarsest stage (128 x 64) is more than the 10 % allowed.
GRIDS = {"unet": ((4, 32, 64), (4, 64, 128)), "crossformer": ((3, 128, 64), (3, 256, 256))}


MODELS = ["unet", pytest.param("crossformer", marks=pytest.mark.credit)]


def layouts(world):
    """(domain shape, shard_dim) this world runs: slabs of all its ranks, and 2 x 2 tiles at 4."""
    if world.size not in (1, 2, 4):
        pytest.skip(f"the grids split into 1, 2 or 4 parts, not {world.size}")
    return [(world.size, -2)] + ([((2, 2), (-2, -1))] if world.size == 4 else [])


def build(world, name, grid=0):
    """The model ``name`` for ``GRIDS[name][grid]`` in float64, seeded alike on every rank (CrossFormer: skipped
    alike on every rank without CREDIT)."""
    if name == "crossformer":
        reasons = world.allgather(credit_missing())
        if any(reasons):
            pytest.skip(f"CREDIT not importable here: {next(r for r in reasons if r)}")
    torch.manual_seed(0)
    if name == "unet":
        return UNet(channels=4, width=8).double()
    return credit_crossformer(1, 2, 1, *GRIDS[name][grid][1:]).double()


def fields(shape, count):
    """``count`` seeded float64 fields of ``(1, *shape)``, alike on every rank."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn((1,) + tuple(shape), dtype=torch.float64, generator=generator) for _ in range(count)]


def rollout(model, x, targets, numel):
    """Step ``x`` (the whole field or this rank's tile) ``len(targets)`` times; return (loss, forecasts).

    The loss is this rank's share of the sum over the steps of the whole field's mean square error
    (``numel`` elements a step): summed over the domain group it is the one-process loss.
    """
    loss, forecasts = 0, []
    for target in targets:
        x = model(x)
        forecasts.append(x)
        loss = loss + (x - target).square().sum() / numel
    return loss, forecasts


def relative(got, want):
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-300)


def gradient_difference(converted, reference):
    """Max |gradient difference| over all parameters, relative to the largest |gradient| of the model."""
    pairs = [(a.grad, b.grad) for a, b in zip(converted.parameters(), reference.parameters()) if b.grad is not None]
    return max((a - b).abs().max().item() for a, b in pairs) / max(b.abs().max().item() for _, b in pairs)


@pytest.mark.parametrize("name", MODELS)
def test_training_rollout_equals_one_process(world, name):
    """Backward through K = 4 steps on tiles: every step's gathered forecast, the loss summed over the
    domain group and the parameter gradients summed over it equal one process's (relative 1e-9). Before
    the all-reduce each rank's gradients are not the whole field's (D > 1): the comparison can fail."""
    shape = GRIDS[name][0]
    x, *targets = fields(shape, STEPS + 1)
    model = build(world, name)
    reference = copy.deepcopy(model)
    want_loss, want = rollout(reference, x, targets, x.numel())
    want_loss.backward()
    for domain, shard_dim in layouts(world):
        with DomainParallelManager(world.size, domain, shard_dim=shard_dim) as manager:
            converted = convert_model(copy.deepcopy(model), manager)
            tile = shard_tensor(x, manager=manager, allow_uneven=True)
            tiles = [shard_tensor(t, manager=manager, allow_uneven=True) for t in targets]
            loss, forecasts = rollout(converted, tile, tiles, x.numel())
            assert all(f.shape == tile.shape for f in forecasts), (domain, [f.shape for f in forecasts])
            loss.backward()
            alone = gradient_difference(converted, reference)
            allreduce_gradients(converted, manager=manager, group="domain", op="sum")
            total = allreduce(loss.detach(), "sum", "domain", manager)
            got = [gather_tensor(f.detach(), manager=manager) for f in forecasts]
        steps = [relative(g, w.detach()) for g, w in zip(got, want)]
        assert max(steps) < TOLERANCE, (domain, steps)
        assert relative(total, want_loss.detach()) < TOLERANCE, (domain, total.item(), want_loss.item())
        assert gradient_difference(converted, reference) < TOLERANCE, domain
        assert world.size == 1 or alone > 1e-3, (domain, alone)


@pytest.mark.parametrize("name", MODELS)
def test_inference_rollout_equals_one_process(world, name):
    """``torch.no_grad`` and ``eval()``: K = 4 steps on tiles, each step's gathered forecast equals one process's."""
    shape = GRIDS[name][0]
    (x,) = fields(shape, 1)
    model = build(world, name).eval()
    with torch.no_grad():
        want = [model(x)]
        for _ in range(STEPS - 1):
            want.append(model(want[-1]))
    for domain, shard_dim in layouts(world):
        with torch.no_grad(), DomainParallelManager(world.size, domain, shard_dim=shard_dim) as manager:
            converted = convert_model(copy.deepcopy(model), manager)
            forecasts = [converted(shard_tensor(x, manager=manager, allow_uneven=True))]
            for _ in range(STEPS - 1):
                forecasts.append(converted(forecasts[-1]))
            got = [gather_tensor(f, manager=manager) for f in forecasts]
        steps = [relative(g, w) for g, w in zip(got, want)]
        assert max(steps) < TOLERANCE, (domain, steps)


def saved_bytes(model, x, targets):
    """Bytes autograd keeps for the backward of a K-step training rollout (parameters left out)."""
    with SavedActivations(exclude=list(model.parameters())) as saved:
        rollout(model, x, targets, x.numel())
    return saved.nbytes


@pytest.mark.parametrize("name", MODELS)
def test_rollout_saved_bytes_per_rank_are_the_tile_share(world, name):
    """K = 4 training rollout on the memory grid: each rank keeps at most 1/D of one process's saved
    bytes plus 10 % (one process: rank 0 measures, the others wait)."""
    shape = GRIDS[name][1]
    x, *targets = [f.float() for f in fields(shape, STEPS + 1)]
    model = build(world, name, grid=1).float()
    whole = saved_bytes(copy.deepcopy(model), x, targets) if world.rank == 0 else None
    wait_politely(world.Ibarrier())
    whole = world.bcast(whole)
    for domain, shard_dim in layouts(world):
        with DomainParallelManager(world.size, domain, shard_dim=shard_dim) as manager:
            converted = convert_model(copy.deepcopy(model), manager)
            tile, *tiles = [shard_tensor(f, manager=manager, allow_uneven=True) for f in [x] + targets]
            mine = saved_bytes(converted, tile, tiles)
        worst = max(world.allgather(mine))
        assert worst <= 1.1 * whole / world.size, (domain, worst, whole, worst / whole)


@pytest.mark.mpi_job
@pytest.mark.bench
def test_rollout_memory_script_patterns_agree(world):
    """scripts/bench/rollout_memory.py at 2 ranks on a small grid: it prints its table, and the sharded rollout and
    CREDIT's pattern (gather, re-shard) give the same forecasts and gradients bit for bit."""
    result = None
    if world.rank == 0:
        done = run_mpi(2, [os.path.join(REPO, "scripts", "bench", "rollout_memory.py"), "--models", "UNet",
                           "--unet-grid", "32x64"], timeout=120)
        result = (done.returncode, done.stdout, done.stderr)
    status, stdout, stderr = share(world, result)
    assert status == 0, stderr[-3000:]
    assert stdout.count("| UNet 32 x 64, 4 channels | latitude slabs |") == 4, stdout
    for pair in ("CREDIT pattern against mpidomain", "CREDIT trainer_gen2 against mpidomain per-step"):
        assert f"{pair}: max |forecast difference| 0.0e+00 over the 4 steps, gradients 0.0e+00" in stdout, stdout

"""Domain-parallel pooling against one process: forward, input gradient (float64), slabs and tiles, uneven shards."""

import pytest

torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.nn import (DomainParallelAdaptiveAvgPool2d, DomainParallelAdaptiveMaxPool2d,  # noqa: E402
                          DomainParallelAvgPool2d, DomainParallelMaxPool2d)
from mpitest import divisors  # noqa: E402
from reference import tile_of  # noqa: E402
from test_layers import compare, counts_for  # noqa: E402
from test_tiles_nn import compare as compare_tiles  # noqa: E402
from test_tiles_nn import layouts, one_process, twins  # noqa: E402

nn = torch.nn

WINDOW_POOLS = [
    ("max 3 stride 2 padding 1", lambda: nn.MaxPool2d(3, stride=2, padding=1)),
    ("max 2", lambda: nn.MaxPool2d(2)),
    ("max 3 stride 2 ceil", lambda: nn.MaxPool2d(3, stride=2, ceil_mode=True)),
    ("max 3 dilation 2 padding 1 ceil", lambda: nn.MaxPool2d(3, stride=2, padding=1, dilation=2, ceil_mode=True)),
    ("max (3, 2) stride (1, 2)", lambda: nn.MaxPool2d((3, 2), stride=(1, 2), padding=(1, 0))),
    ("avg 2", lambda: nn.AvgPool2d(2)),
    ("avg 3 stride 2 padding 1", lambda: nn.AvgPool2d(3, stride=2, padding=1)),
    ("avg 3 stride 2 padding 1 exclude pad ceil", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True,
                                                                       count_include_pad=False)),
    ("avg 3 stride 2 padding 1 include pad ceil", lambda: nn.AvgPool2d(3, 2, 1, ceil_mode=True)),
    ("avg 2 stride 3 ceil", lambda: nn.AvgPool2d(2, 3, ceil_mode=True)),
    ("avg 3 divisor 5", lambda: nn.AvgPool2d(3, 2, 1, divisor_override=5)),
]

ADAPTIVE = [
    ("adaptive avg 1", lambda: nn.AdaptiveAvgPool2d(1)),
    ("adaptive avg (5, 3)", lambda: nn.AdaptiveAvgPool2d((5, 3))),
    ("adaptive avg (None, 1)", lambda: nn.AdaptiveAvgPool2d((None, 1))),
    ("adaptive avg (1, None)", lambda: nn.AdaptiveAvgPool2d((1, None))),
    ("adaptive avg (7, 4): overlapping bins", lambda: nn.AdaptiveAvgPool2d((7, 4))),
    ("adaptive max 1", lambda: nn.AdaptiveMaxPool2d(1)),
    ("adaptive max (6, 5)", lambda: nn.AdaptiveMaxPool2d((6, 5))),
    ("adaptive avg (40, 25): more outputs than rows", lambda: nn.AdaptiveAvgPool2d((40, 25))),
]

WRAPPERS = {nn.MaxPool2d: DomainParallelMaxPool2d, nn.AvgPool2d: DomainParallelAvgPool2d,
            nn.AdaptiveAvgPool2d: DomainParallelAdaptiveAvgPool2d,
            nn.AdaptiveMaxPool2d: DomainParallelAdaptiveMaxPool2d}


def wrap(pool, shard_dim, manager):
    return WRAPPERS[type(pool)](pool, shard_dim, manager)


def compare_replicated(manager, single, parallel, shape, counts):
    """A global pool: every rank's output is the whole output; the gradient of the loss taken once (rank 0)."""
    full, full_in, reference, weights = one_process(single, shape)
    rank = manager.domain_rank
    start = sum(counts[:rank])
    local_in = full.narrow(-2, start, counts[rank]).clone().requires_grad_()
    out = parallel(local_in)
    problems = []
    if out.shape != reference.shape or float((out.detach() - reference.detach()).abs().max()) > 1e-12:
        problems.append(f"output {tuple(out.shape)} differs from one process on rank {manager.rank}")
        return problems
    (out * weights * (1.0 if rank == 0 else 0.0)).sum().backward()  # every rank runs backward: it is collective
    want = full_in.grad.narrow(-2, start, counts[rank])
    if float((local_in.grad - want).abs().max()) > 1e-12:
        problems.append(f"input gradient differs on rank {manager.rank}")
    return problems


def test_pools_on_every_slab_layout_equal_one_process(world):
    """Every pool on latitude slabs of every D dividing the world, even, uneven and odd-start shards."""
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            for label, make in WINDOW_POOLS + ADAPTIVE:
                for rows_per_rank, extra in ((7, 3), (9, 1)):  # uneven shards of odd rows: odd starts
                    shape = (2, 3, rows_per_rank * D + extra, 11)
                    counts = counts_for(shape[-2], D)
                    single = make()
                    parallel = wrap(make(), -2, manager)
                    try:
                        if global_dims(single)[0] and D > 1:
                            found = compare_replicated(manager, single, parallel, shape, counts)
                        else:
                            found = compare(manager, single, parallel, shape, counts)
                    except Exception as error:  # collective errors raise alike on every rank
                        found = [f"raised {type(error).__name__}: {error}"]
                    problems += [f"D={D} {label} {counts}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def global_dims(pool):
    """(global along latitude, global along longitude): output size 1 there, the same on every tile."""
    sizes = getattr(pool, "output_size", None)
    sizes = (sizes, sizes) if isinstance(sizes, int) else (sizes or (None, None))
    return sizes[0] == 1, sizes[1] == 1


def compare_tiles_global(manager, single, parallel, shape):
    """Tiles and a pool global along some dim: assemble one copy along it; the loss counted once."""
    full, full_in, reference, weights = one_process(single, shape)
    local_in = tile_of(full, manager).clone().requires_grad_()
    out = parallel(local_in)
    lat, lon = global_dims(single)
    i, j = manager.domain_coords
    tiles = {(a, b): t for a, b, t in manager.domain_comm.allgather((*manager.domain_coords, out.detach()))}
    rows = sorted({a for a, _ in tiles} if not lat else {0})
    cols = sorted({b for _, b in tiles} if not lon else {0})
    whole = torch.cat([torch.cat([tiles[a, b] for b in cols], -1) for a in rows], -2)
    if whole.shape != reference.shape or float((whole - reference.detach()).abs().max()) > 1e-12:
        return [f"output differs on tile {(i, j)}"]
    top = 0 if lat else sum(tiles[a, 0].shape[-2] for a in rows if a < i)
    left = 0 if lon else sum(tiles[0, b].shape[-1] for b in cols if b < j)
    once = (i == 0 or not lat) and (j == 0 or not lon)
    w = weights[..., top:top + out.shape[-2], left:left + out.shape[-1]] * (1.0 if once else 0.0)
    (out * w).sum().backward()
    if float((local_in.grad - tile_of(full_in.grad, manager)).abs().max()) > 1e-12:
        return [f"input gradient differs on tile {(i, j)}"]
    return []


def test_pools_on_tiles_equal_one_process(world):
    """Every pool on every (D_lat, D_lon) tiling of the world, uneven tiles (13 x 19)."""
    problems = []
    for tiling in layouts(world.size):
        with DomainParallelManager(world.size, tiling, (-2, -1)) as manager:
            for label, make in WINDOW_POOLS + ADAPTIVE:
                single, copy = twins(make)
                parallel = wrap(copy, (-2, -1), manager)
                try:
                    if any(global_dims(single)):
                        found = compare_tiles_global(manager, single, parallel, (2, 2, 13, 19))
                    else:
                        found = compare_tiles(manager, single, parallel, (2, 2, 13, 19))
                except Exception as error:
                    found = [f"raised {type(error).__name__}: {error}"]
                problems += [f"{tiling} {label}: {p}" for p in found]
    assert not problems, "\n".join(problems)


def test_a_layout_a_pool_cannot_run_raises_the_same_error_on_every_rank(world):
    if world.size == 1:
        pytest.skip("one rank holds the whole field")
    with DomainParallelManager(world.size, world.size) as manager:
        pool = DomainParallelMaxPool2d(nn.MaxPool2d(7, stride=2, padding=3), manager=manager)
        try:
            pool(torch.zeros(1, 1, 2, 4))  # 2 rows per rank; a window needs 3 of each neighbour
            message = None
        except ValueError as error:
            message = str(error)
    messages = world.allgather(message)
    assert messages[0] is not None and len(set(messages)) == 1, messages
    assert "DomainParallelMaxPool2d(kernel=7, stride=2, dilation=1, padding=3, ceil_mode=False along dim 2) cannot " \
           "run on shards of [2, 2" in messages[0]

"""shard_tensor, gather_tensor and scatter_tensor on 2-D tiles: exact, uneven, and errors on every rank."""

import numpy as np
import pytest

import mpidomain
from mpidomain import DomainParallelManager, gather_tensor, scatter_tensor, shard_tensor
from reference import tile_of

torch = pytest.importorskip("torch")


def layouts(size):
    """Every (D_lat, D_lon) of ``size`` ranks."""
    return [(a, size // a) for a in range(1, size + 1) if size % a == 0]


def field(kind, shape):
    values = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * 0.5
    return torch.from_numpy(values) if kind == "torch" else values


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("shape", [(2, 3, 8, 12), (1, 2, 7, 9), (2, 1, 3, 5, 11)])
def test_tiles_round_trip_exactly(world, kind, shape):
    """Each rank's tile is the slice of each dim's balanced split; gather and scatter give the field and tile back."""
    problems = []
    full = field(kind, shape)
    for layout in layouts(world.size):
        with DomainParallelManager(world.size, layout, (-2, -1)) as manager:
            tile = shard_tensor(full, manager=manager, allow_uneven=True)
            if not np.array_equal(np.asarray(tile), np.asarray(tile_of(full, manager))):
                problems.append(f"{layout}: shard_tensor tile differs")
            whole = gather_tensor(tile, dim=(-2, -1), manager=manager)
            if type(whole) is not type(full) or not np.array_equal(np.asarray(whole), np.asarray(full)):
                problems.append(f"{layout}: gather_tensor differs from the field")
            out = np.empty_like(np.asarray(full)) if kind == "numpy" else torch.empty_like(full)
            gather_tensor(tile, manager=manager, out=out)
            if not np.array_equal(np.asarray(out), np.asarray(full)):
                problems.append(f"{layout}: gather_tensor(out=) differs")
            root = manager.domain_parallel_size - 1
            scattered = scatter_tensor(full if manager.domain_rank == root else None, root=root, manager=manager)
            if not np.array_equal(np.asarray(scattered), np.asarray(tile)):
                problems.append(f"{layout}: scatter_tensor from rank {root} differs from shard_tensor")
    assert not problems, problems


def test_shard_tensor_on_tiles_keeps_autograd(world):
    """A Torch tile keeps its history: the gradient lands on this tile's part of the field."""
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        full = torch.ones(1, 1, 4, 2 * world.size, dtype=torch.float64, requires_grad=True)
        shard_tensor(full, manager=manager).sum().backward()
        assert float(full.grad.sum()) == 4 * 2  # this rank's 4 x 2 tile


def _messages(world, call):
    try:
        call()
        return world.allgather(None)
    except (ValueError, TypeError) as error:
        return world.allgather(f"{type(error).__name__}: {error}")


def test_mistakes_raise_the_same_error_on_every_rank(world):
    """An int dim on tiles, a pair on slabs, ranks disagreeing on dim, tiles of different arrays."""
    if world.size < 2:
        pytest.skip("a domain of one rank shards nothing")
    full = np.zeros((1, 1, 8, 12))  # 12 columns: even tiles for 1 to 4 ranks
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        tile = shard_tensor(full, manager=manager)
        cases = {
            "int dim on tiles": lambda: gather_tensor(tile, dim=-2, manager=manager),
            "one rank's int dim": lambda: gather_tensor(tile, dim=-2 if world.rank == 0 else None, manager=manager),
            "different arrays": lambda: gather_tensor(tile if world.rank else tile[..., :1, :], manager=manager),
            "scatter int dim": lambda: scatter_tensor(full if world.rank == 0 else None, dim=-1, manager=manager),
        }
        results = {name: _messages(world, call) for name, call in cases.items()}
    with DomainParallelManager(world.size, world.size) as slabs:
        results["pair on slabs"] = _messages(world, lambda: gather_tensor(full[..., :1, :], dim=(-2, -1),
                                                                          manager=slabs))
    bad = {name: m for name, m in results.items() if m[0] is None or len(set(m)) != 1}
    assert not bad, bad
    assert "must be a pair of dims" in results["int dim on tiles"][0]
    assert "must be one dim" in results["pair on slabs"][0]


def test_uneven_tiles_need_allow_uneven(world):
    """Extents the ranks along a dim do not divide raise ValueError unless allow_uneven."""
    with DomainParallelManager(world.size, (1, world.size), (-2, -1)) as manager:
        x = np.zeros((1, 1, 3, 2 * world.size + 1))
        if world.size == 1:
            assert shard_tensor(x, manager=manager) is x
        else:
            with pytest.raises(ValueError, match="Cannot shard dim 3"):
                shard_tensor(x, manager=manager)
            assert mpidomain.shard_tensor(x, manager=manager, allow_uneven=True).shape[-1] in (2, 3)

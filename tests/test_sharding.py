"""Sharding, gathering and scattering against the full array, at whatever world size runs the suite."""

import numpy as np
import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import (DomainParallelManager, balanced_split, devices, gather_tensor, scatter_tensor,
                       shard_batch, shard_tensor)
from mpitest import divisors

# (shape, dims): extents 8 and 12 divide by 1, 2 and 4; 7, 9, 5 and 3 do not (3 < 4 leaves a rank empty).
SHAPES = [((2, 3, 8, 12), (-2, -1, 0)), ((2, 3, 7, 5), (-2, -1, 1)), ((1, 2, 3, 9, 4), (-2, 2, -3))]


def _d(world, index):
    sizes = divisors(world.size)
    if index >= len(sizes):
        pytest.skip(f"world of {world.size} has only {len(sizes)} divisors")
    return sizes[index]


def _full(shape, seed, kind, dtype="float32"):
    values = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(values)
    return values


def _equal(a, b):
    assert type(a) is type(b) and tuple(a.shape) == tuple(b.shape) and str(a.dtype) == str(b.dtype)
    return bool((a == b).all())


def test_balanced_split():
    assert balanced_split(721, 4) == ((181, 180, 180, 180), (0, 181, 361, 541))
    assert balanced_split(8, 4) == ((2, 2, 2, 2), (0, 2, 4, 6))
    assert balanced_split(2, 4) == ((1, 1, 0, 0), (0, 1, 2, 2))
    assert balanced_split(5, 1) == ((5,), (0,))
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        balanced_split(5, 0)
    with pytest.raises(TypeError, match=r"extent must be an int, got 7.5 \(float\)"):
        balanced_split(7.5, 2)
    # One split: the pure layout module's, public from mpidomain and mpidomain.sharding as before.
    assert balanced_split is mpidomain.sharding.balanced_split is mpidomain.layout.tiles.balanced_split


def test_no_manager_or_one_rank_returns_x(world, fresh_manager):
    x = np.arange(24.0).reshape(2, 3, 4)
    assert mpidomain.get_domain_parallel_manager() is None
    assert shard_tensor(x) is x  # local: CREDIT's semantics, no manager means no split
    batch = {"x": x}
    assert shard_batch(batch) is batch
    if world.size == 1:
        assert gather_tensor(x) is x and scatter_tensor(x) is x
        with pytest.raises(ValueError, match="scatter_tensor got x=None"):
            scatter_tensor(None)
    else:  # collective entry points, like halo_exchange and allreduce, refuse to work alone
        for function in (gather_tensor, scatter_tensor):
            with pytest.raises(RuntimeError, match=f"{function.__name__} needs a domain-parallel manager, but none "
                                                   f"is initialised in this {world.size}-process job"):
                function(x)
    with DomainParallelManager(world.size, 1) as m:
        assert shard_tensor(x, manager=m) is x and gather_tensor(x, manager=m) is x
        assert scatter_tensor(x, manager=m) is x and shard_batch(batch, manager=m) is batch
        with pytest.raises(ValueError, match="scatter_tensor got x=None"):
            scatter_tensor(None, manager=m)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("d_index", range(3))
def test_round_trips(world, d_index, kind):
    d = _d(world, d_index)
    with DomainParallelManager(world.size, d) as m:
        for shape, dims in SHAPES:
            full = _full(shape, seed=m.mesh.group_index("domain"), kind=kind)
            for dim in dims:
                extent = shape[dim]
                counts, offsets = balanced_split(extent, d)
                if extent % d:
                    with pytest.raises(ValueError, match=f"Cannot shard dim {dim % len(shape)} of size {extent}"):
                        shard_tensor(full, dim, m)
                mine = shard_tensor(full, dim, m, allow_uneven=True)
                index = (slice(None),) * (dim % len(shape)) + (slice(offsets[m.domain_rank], offsets[m.domain_rank]
                                                                       + counts[m.domain_rank]),)
                assert _equal(mine, full[index]), (shape, dim)
                assert devices.contiguous(mine) is mine
                assert _equal(gather_tensor(mine, dim, m), full), (shape, dim)
                for root in sorted({0, d - 1}):
                    given = full if m.domain_rank == root else None
                    assert _equal(scatter_tensor(given, dim, root, m), mine), (shape, dim, root)


def test_shard_is_a_copy(world):
    d = _d(world, 1)
    with DomainParallelManager(world.size, d) as m:
        full = np.zeros((d * 2, 3))
        mine = shard_tensor(full, 0, m)
        mine += 1
        assert not full.any()


def test_torch_details(world):
    torch = pytest.importorskip("torch")
    d = world.size
    with DomainParallelManager(world.size, d) as m:
        full = torch.randn(2, 3, 4 * d + 1, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
        mine = shard_tensor(full, manager=m, allow_uneven=True)
        mine.sum().backward()  # sharding keeps autograd: ones on our rows
        counts, offsets = balanced_split(full.shape[2], d)
        expected = torch.zeros_like(full)
        expected[:, :, offsets[m.domain_rank]:offsets[m.domain_rank] + counts[m.domain_rank]] = 1
        assert torch.equal(full.grad, expected)
        for dtype in (torch.bfloat16, torch.int64, torch.bool):
            whole = full.detach().to(dtype)
            assert torch.equal(gather_tensor(shard_tensor(whole, manager=m, allow_uneven=True), manager=m), whole)
        # A non-contiguous shard (a transposed view) gathers like its contiguous copy.
        view = full.detach().transpose(2, 3)
        assert torch.equal(gather_tensor(shard_tensor(view, -1, m, allow_uneven=True).transpose(2, 3), -2, m), full)


def test_device_paths_on_host_memory(world, fake_device_path):
    """Run the device code paths on CPU tensors posing as device arrays (the GPU machines run them for real)."""
    torch = pytest.importorskip("torch")
    d = world.size
    with DomainParallelManager(world.size, d) as m:
        full = torch.randn(2, 3, 2 * d + 1, 5, generator=torch.Generator().manual_seed(1), requires_grad=True)
        for dim in (-2, -1, 0):
            mine = shard_tensor(full, dim, m, allow_uneven=True)
            assert torch.equal(gather_tensor(mine, dim, m), full)
            assert torch.equal(scatter_tensor(full if m.domain_rank == 0 else None, dim, 0, m), mine)


def _cuda_arrays():
    arrays = []
    try:
        import torch

        if torch.cuda.is_available():
            arrays.append(("torch", lambda a: torch.from_numpy(a).cuda()))
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount():
            arrays.append(("cupy", cupy.asarray))
    except Exception:  # cupy missing or no driver
        pass
    return arrays


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_device_round_trips(world, monkeypatch, cuda_aware):
    arrays = _cuda_arrays()
    if not world.allreduce(len(arrays) > 0, op=MPI.LAND):
        pytest.skip("needs a CUDA device (torch or cupy) on every rank")
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", "1" if cuda_aware else "0")
    devices.cuda_aware_decision(refresh=True)
    d = world.size
    try:
        if world.size > 1 and devices.cuda_aware_decision().conflict:  # forced direct, MPI without CUDA: refused
            with DomainParallelManager(world.size, d) as m:
                for _, to_device in arrays:
                    mine = shard_tensor(to_device(np.ones((2, 2 * d, 3), np.float32)), -2, m)
                    with pytest.raises(RuntimeError, match="MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI"):
                        gather_tensor(mine, -2, m)
            return
        with DomainParallelManager(world.size, d) as m:
            host = np.random.default_rng(2).standard_normal((2, 3, 2 * d + 1, 5)).astype(np.float32)
            for _, to_device in arrays:
                full = to_device(host)
                for dim in (-2, -1):
                    mine = shard_tensor(full, dim, m, allow_uneven=True)
                    gathered = gather_tensor(mine, dim, m)
                    assert devices.is_device_array(gathered)
                    assert np.array_equal(devices.copy_to_host(gathered, np.empty(host.shape, np.float32)), host)
                    scattered = scatter_tensor(full if m.domain_rank == 0 else None, dim, 0, m)
                    assert devices.is_device_array(scattered) and bool((scattered == mine).all())
    finally:
        monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
        devices.cuda_aware_decision(refresh=True)


def test_shard_batch_rules(world):
    torch = pytest.importorskip("torch")
    d = world.size
    with DomainParallelManager(world.size, d) as m:
        batch = {
            "x": torch.randn(1, 2, 3, 4 * d, 6),      # 5-D: sharded along spatial_dims_5d
            "y": torch.randn(1, 2, 6, 4 * d),         # 4-D: sharded along spatial_dims_4d
            "static": np.ones((1, 2, 6, 4 * d)),      # 4-D NumPy: sharded too
            "forcing": torch.randn(2, 4 * d, 6),      # 3-D: untouched
            "index": torch.tensor(7),
            "stop_forecast": True,
            "name": "era5",
            "times": [1, 2],
        }
        out = shard_batch(batch, spatial_dims_5d=-2, spatial_dims_4d=-1, manager=m)
        if d == 1:
            assert out is batch  # CREDIT's semantics: nothing to shard
            return
        assert out is not batch and set(out) == set(batch)
        assert torch.equal(out["x"], shard_tensor(batch["x"], -2, m))
        assert torch.equal(out["y"], shard_tensor(batch["y"], -1, m))
        assert np.array_equal(out["static"], shard_tensor(batch["static"], -1, m))
        for key in ("forcing", "index", "stop_forecast", "name", "times"):
            assert out[key] is batch[key]
        with pytest.raises(ValueError, match="Cannot shard"):
            shard_batch({"y": torch.zeros(1, 1, 4 * d + 1, 2)}, manager=m)
        assert shard_batch({"y": torch.zeros(1, 1, 4 * d + 1, 2)}, manager=m, allow_uneven=True)["y"].shape[-2] \
            == balanced_split(4 * d + 1, d)[0][m.domain_rank]


def test_local_errors(world):
    d = _d(world, 1)
    with DomainParallelManager(world.size, d) as m:
        with pytest.raises(ValueError, match=r"dim=4 is out of range for a 2-d array of shape \(2, 3\); pass a dim between -2 and 1"):
            shard_tensor(np.zeros((2, 3)), 4, m)
        with pytest.raises(TypeError, match="dim must be an int, got 'h'"):
            shard_tensor(np.zeros((2, 3)), "h", m)
        with pytest.raises(TypeError, match="expected a NumPy array, CuPy array or Torch tensor, got builtins.list"):
            shard_tensor([1, 2], 0, m)


def _world_split(world):
    if world.size == 1:
        pytest.skip("needs two or more ranks")
    return DomainParallelManager(world.size, world.size)


def test_gather_mismatch_raises_everywhere(world):
    with _world_split(world) as m:
        odd = (2, 3 + (m.domain_rank == 1), 4, 5)  # only rank 1 differs outside dim
        with pytest.raises(ValueError, match=r"same dtype and the same extents outside dim 2 on every rank, got .*"
                                             r"rank 1: shape \(2, 4, 4, 5\) float32"):
            gather_tensor(np.zeros(odd, np.float32), -2, m)
        dtype = "float64" if m.domain_rank == 0 else "float32"
        with pytest.raises(ValueError, match="rank 0: shape \\(2, 3, 4, 5\\) float64"):
            gather_tensor(np.zeros((2, 3, 4, 5), dtype), -2, m)
        with pytest.raises(ValueError, match="same number of dimensions and the same dim"):
            gather_tensor(np.zeros((2, 3, 4, 5)), -2 if m.domain_rank else 1, m)
        with pytest.raises(ValueError, match=r"rank 0: dim=7 is out of range"):
            gather_tensor(np.zeros((2, 3, 4, 5)), 7 if m.domain_rank == 0 else -2, m)


def test_scatter_errors_raise_everywhere(world):
    with _world_split(world) as m:
        with pytest.raises(ValueError, match=r"got x=None on the root \(domain rank 0\)"):
            scatter_tensor(None, -2, 0, m)
        with pytest.raises(ValueError, match=f"root=9 is not a domain rank; pass a root between 0 and {world.size - 1}"):
            scatter_tensor(np.zeros((4, 4)), -2, 9, m)
        with pytest.raises(ValueError, match="same root and dim on every rank, got rank 0: root=0"):
            scatter_tensor(np.zeros((4, 4)), -2, 0 if m.domain_rank == 0 else 1, m)
        with pytest.raises(ValueError, match="dim=5 is out of range"):
            scatter_tensor(np.zeros((4, 4)) if m.domain_rank == 0 else None, 5, 0, m)
        # After the errors the group is still in step.
        full = np.arange(16.0).reshape(4, 4)
        assert np.array_equal(scatter_tensor(full if m.domain_rank == 0 else None, 0, 0, m),
                              shard_tensor(full, 0, m, allow_uneven=True))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_arrays(world, kind):
    with _world_split(world) as m:
        full = _full((2, 3, 2 * world.size + 1, 4), seed=3, kind=kind)
        mine = shard_tensor(full, manager=m, allow_uneven=True)
        out = devices.empty(tuple(full.shape), like=full)
        assert gather_tensor(mine, manager=m, out=out) is out and _equal(out, full)
        shard_out = devices.empty(tuple(mine.shape), like=mine)
        assert scatter_tensor(full if m.domain_rank == 0 else None, manager=m, out=shard_out) is shard_out
        assert _equal(shard_out, mine)


def test_bad_out_raises_everywhere(world):
    with _world_split(world) as m:
        mine = np.ones((2, 3, 4), np.float32)
        out = np.empty((2, 3 + (m.domain_rank == 1), 4 * world.size), np.float32)
        with pytest.raises(ValueError, match=r"gather_tensor: out does not fit the result on every rank: rank 1: "
                                             r"needs a C-contiguous numpy float32 array on cpu of shape \(2, 3, \d+\), "
                                             r"got numpy float32 on cpu of shape \(2, 4, \d+\)"):
            gather_tensor(mine, -1, m, out=out)
        wide = np.empty((2, 3, 8), np.float64)[:, :, ::2]
        with pytest.raises(ValueError, match="rank 0: needs a C-contiguous numpy float32 .* got a non-contiguous numpy float64"):
            scatter_tensor(np.ones((2, 3, 4 * world.size), np.float32), -1, 0, m, out=wide if m.domain_rank == 0 else None)

"""Halo exchange against a global reference, plans in place, errors on every rank, and no leaks.

Every rank of a domain group builds the same global field (one per domain
group), takes its shard, exchanges, and compares bit for bit with its slice
of the globally padded field.
"""

import gc
import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import DomainParallelManager, HaloPlan, halo_exchange
from mpidomain.halo import cache as plan_cache, call as halo_call, plan as halo
from mpitest import divisors
from reference import bounds as shard_bounds
from reference import padded_rows

import reference

# (shape with N marking the sharded extent, dim)
LAYOUTS = {"4d-dim-2": ((2, 3, "N", 5), -2), "4d-dim-1": ((2, 3, 4, "N"), -1), "5d-dim3": ((2, 1, 3, "N", 4), 3)}


def global_field(template, extent, seed, dtype=np.float32):
    """The global field of ``template`` with ``extent`` rows where it says ``"N"``."""
    shape = tuple(extent if s == "N" else s for s in template)
    return reference.global_field(shape, seed, dtype, int_scale=100)


def local_case(manager, template, dim, h, periodic, uneven, dtype=np.float32):
    """Return (shard, expected padded shard) for this rank."""
    d = manager.domain_parallel_size
    extent = 3 * d + (d - 1 if uneven else 0) + (1 if uneven and d == 1 else 0)
    field = global_field(template, extent, seed=1000 + manager.mesh.group_index("domain"), dtype=dtype)
    axis = dim % field.ndim
    start, n = shard_bounds(extent, d, manager.domain_rank)
    shard = np.take(field, range(start, start + n), axis=axis)
    return shard, padded_rows(field, dim, h, periodic, start, n)


def as_kind(array, kind):
    if kind == "torch":
        torch = pytest.importorskip("torch")
        return torch.from_numpy(np.ascontiguousarray(array))
    return array


def to_numpy(array):
    return array if isinstance(array, np.ndarray) else array.detach().cpu().numpy()


def all_cases(world):
    for d in divisors(world.size):
        for h in (1, 2, 3):
            for periodic in (False, True):
                for uneven in (False, True):
                    yield d, h, periodic, uneven


# Host halos arrive through subarray datatypes from _IN_PLACE_RECEIVE_BYTES on, else in buffers.
RECEIVES = {"datatype receives": 0, "buffer receives": 1 << 60}


@pytest.mark.parametrize("receive", sorted(RECEIVES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_matches_global_reference(world, monkeypatch, kind, layout, receive):
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", RECEIVES[receive])
    template, dim = LAYOUTS[layout]
    for d, h, periodic, uneven in all_cases(world):
        with DomainParallelManager(world.size, d, shard_dim=dim) as manager:
            shard, expected = local_case(manager, template, dim, h, periodic, uneven)
            x = as_kind(shard, kind)
            out = halo_exchange(x, h, periodic=periodic, manager=manager)
            assert type(out) is type(x) and out.dtype == x.dtype
            case = f"D={d} h={h} periodic={periodic} uneven={uneven}"
            assert out.shape == expected.shape, case
            assert np.array_equal(to_numpy(out), expected), case


@pytest.mark.parametrize("receive", sorted(RECEIVES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_plan_refreshes_ghosts_in_place(world, monkeypatch, kind, receive):
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", RECEIVES[receive])
    template, dim = LAYOUTS["4d-dim-2"]
    for d, h, periodic, uneven in all_cases(world):
        with DomainParallelManager(world.size, d) as manager:
            shard, expected = local_case(manager, template, dim, h, periodic, uneven)
            x = as_kind(shard, kind)
            with HaloPlan(x, h, dim, periodic=periodic, manager=manager) as plan:
                padded = plan.empty()
                assert tuple(padded.shape) == plan.padded_shape == expected.shape
                plan.interior(padded)[...] = x
                interior_address = to_numpy(plan.interior(padded)).__array_interface__["data"][0]
                for step in range(3):
                    to_numpy(padded)[...] = -7  # stale ghosts must all be overwritten
                    plan.interior(padded)[...] = x
                    if step == 2:
                        plan.start(padded)
                        assert plan.wait() is padded
                    else:
                        assert plan.exchange(padded) is padded
                    assert np.array_equal(to_numpy(padded), expected), f"D={d} h={h} periodic={periodic} step={step}"
                assert to_numpy(plan.interior(padded)).__array_interface__["data"][0] == interior_address
                other = plan.pad(x)
                assert np.array_equal(to_numpy(other), expected)
                assert np.array_equal(to_numpy(plan.exchange(padded)), expected)


def test_uneven_era5_latitudes(world):
    """721 latitudes over the domain group: 181/180/180/180 with four ranks."""
    d = world.size
    with DomainParallelManager(world.size, d) as manager:
        field = global_field((1, 2, "N", 3), 721, seed=5)
        start, n = shard_bounds(721, d, manager.domain_rank)
        if d == 4:
            assert n == (181 if manager.domain_rank == 0 else 180)
        for periodic in (False, True):
            out = halo_exchange(field[:, :, start:start + n], 2, periodic=periodic, manager=manager)
            assert np.array_equal(out, padded_rows(field, -2, 2, periodic, start, n))


def test_device_transports_on_host(world, fake_device_path):
    """The direct and staged paths (used for GPU memory) give the host path's results."""
    torch = pytest.importorskip("torch")
    template, dim = LAYOUTS["5d-dim3"]
    for d in divisors(world.size):
        for h, periodic, uneven in ((1, False, True), (3, True, False), (2, True, True)):
            with DomainParallelManager(world.size, d) as manager:
                shard, expected = local_case(manager, template, dim, h, periodic, uneven)
                for x in (shard, torch.from_numpy(shard.copy())):
                    out = halo_exchange(x, h, dim, periodic=periodic, manager=manager)
                    assert np.array_equal(to_numpy(out), expected)
                    with HaloPlan(x, h, dim, periodic=periodic, manager=manager) as plan:
                        assert plan.transport.name == fake_device_path
                        padded = plan.pad(x)
                        plan.interior(padded)[...] = x
                        assert np.array_equal(to_numpy(plan.exchange(padded)), expected)


@pytest.mark.parametrize("dtype", ["float64", "int16", "complex64", "bool", "bfloat16", "float16"])
def test_dtypes_travel_bitwise(world, dtype):
    torch = pytest.importorskip("torch")
    with DomainParallelManager(world.size, world.size) as manager:
        shard, expected = local_case(manager, (2, "N", 3), 1, 2, True, True, dtype="float32")
        if dtype == "bfloat16":
            x = torch.from_numpy(shard).to(torch.bfloat16)
            want = torch.from_numpy(expected).to(torch.bfloat16)
        else:
            x = shard.astype(dtype) if dtype != "bool" else shard > 0
            want = expected.astype(dtype) if dtype != "bool" else expected > 0
        out = halo_exchange(x, 2, 1, periodic=True, manager=manager)
        assert out.dtype == x.dtype
        if dtype == "bfloat16":
            assert torch.equal(out.view(torch.int16), want.view(torch.int16))
        else:
            assert np.array_equal(out, want)


def test_zero_width_and_noncontiguous_input(world):
    with DomainParallelManager(world.size, world.size) as manager:
        shard, expected = local_case(manager, (3, "N", 4), 1, 1, False, False)
        out = halo_exchange(shard, 0, 1, manager=manager)
        assert np.array_equal(out, shard) and out is not shard
        transposed = np.ascontiguousarray(np.swapaxes(shard, 0, 2)).swapaxes(0, 2)  # same values, other strides
        assert not transposed.flags.c_contiguous
        assert np.array_equal(halo_exchange(transposed, 1, 1, manager=manager), expected)


def test_default_dim_is_the_managers_shard_dim(world, fresh_manager):
    mpidomain.initialize_domain_parallel(world.size, world.size, shard_dim=-1, abort_on_error=False)
    manager = mpidomain.get_domain_parallel_manager()
    shard, expected = local_case(manager, (2, 3, "N"), -1, 1, True, False)
    assert np.array_equal(halo_exchange(shard, 1, periodic=True), expected)


# -- the plan cache and lifetimes ------------------------------------------------------


def test_cache_is_bounded_and_frees_evicted_plans(world):
    with DomainParallelManager(world.size, world.size) as manager:
        x = np.zeros((2, 4, 3), np.float32)
        halo_exchange(x, 1, 1, manager=manager)
        first, = plan_cache.cached_plans(manager)
        halo_exchange(x, 1, -2, manager=manager)  # the same axis spelled differently: a hit
        assert plan_cache.cached_plans(manager) == [first]  # a hit, not a new plan
        for width in range(2, 2 + plan_cache.CACHE_SIZE):
            halo_exchange(np.zeros((2, 20, 3), np.float32), width, 1, manager=manager)
        assert len(plan_cache.cached_plans(manager)) == plan_cache.CACHE_SIZE
        assert first.freed and first.live_handles() == {"requests": 0, "datatypes": 0}
    assert plan_cache.cached_plans(manager) == []


def test_manager_close_frees_plans(world):
    manager = DomainParallelManager(world.size, world.size)
    x = np.zeros((2, 4, 3))
    cached = halo_call.cached_plan(x, 1, 1, manager=manager)
    own = HaloPlan(x, 2, 1, periodic=True, manager=manager)
    own.exchange(own.pad(x))
    manager.close()
    for plan in (cached, own):
        assert plan.freed and plan.live_handles() == {"requests": 0, "datatypes": 0}
    with pytest.raises(RuntimeError, match="was freed"):
        own.exchange(np.zeros(own.padded_shape))
    with pytest.raises(RuntimeError, match="is closed"):
        halo_exchange(x, 1, 1, manager=manager)


def _rss_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_ten_thousand_exchanges_leak_nothing(world, monkeypatch):
    """6,000 in-place exchanges and 4,000 halo_exchange calls: flat memory, no MPI handles left."""
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", 0)  # datatypes too
    with DomainParallelManager(world.size, world.size) as manager:
        x = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)
        plan = HaloPlan(x, 1, 1, periodic=True, manager=manager)
        padded = plan.pad(x)
        tracemalloc.start()  # before the warm-up: NumPy fills a cache once while traced
        for _ in range(200):  # warm up allocators and caches
            plan.exchange(padded)
            halo_exchange(x, 1, 1, periodic=True, manager=manager)
        gc.collect()
        before, rss_before = tracemalloc.get_traced_memory()[0], _rss_bytes()
        for _ in range(6000):
            plan.exchange(padded)
        for _ in range(4000):
            halo_exchange(x, 1, 1, periodic=True, manager=manager)
        gc.collect()
        after, rss_after = tracemalloc.get_traced_memory()[0], _rss_bytes()
        tracemalloc.stop()
        # Under 5 bytes per call: any object leaked per call (>= 16 bytes) would show; the
        # per-call agreement step leaves a few KiB of allocator noise that does not grow.
        assert after - before < 48 * 1024, f"Python allocations grew by {after - before} bytes"
        assert rss_after - rss_before < 4 * 1024 * 1024, f"RSS grew by {rss_after - rss_before} bytes"
        expected = padded_rows(x, 1, 1, True, 0, 4) if world.size == 1 else None
        if expected is not None:
            assert np.array_equal(padded, expected)
        cached = plan_cache.cached_plans(manager)
        handles = [*plan._requests, *plan._recv_types]
        for p in cached:
            handles += [*p._requests, *p._recv_types]
        live = plan.live_handles()
        peers = min(world.size - 1, 2)  # one message each way per peer: with 2 ranks, both sides are one peer
        assert live == {"requests": 2 * peers, "datatypes": peers}, live
        plan.free()
    for p in [plan, *cached]:
        assert p.live_handles() == {"requests": 0, "datatypes": 0}
    null = (MPI.REQUEST_NULL, MPI.DATATYPE_NULL)
    assert all(any(handle == n for n in null) for handle in handles)


@pytest.mark.parametrize("receive", sorted(RECEIVES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_pad_reuses_memory_only_once_dropped(world, monkeypatch, kind, receive):
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", RECEIVES[receive])
    with DomainParallelManager(world.size, world.size) as manager:
        shard, expected = local_case(manager, (2, "N", 3), 1, 1, True, True)
        x = as_kind(shard, kind)
        first = halo_exchange(x, 1, 1, periodic=True, manager=manager)
        address = to_numpy(first).__array_interface__["data"][0]
        second = halo_exchange(x, 1, 1, periodic=True, manager=manager)  # `first` is alive: new memory
        assert to_numpy(second).__array_interface__["data"][0] != address
        kept = to_numpy(second)[0]  # a view keeps `second`'s memory alive too
        second_address = to_numpy(second).__array_interface__["data"][0]
        del first, second
        third = halo_exchange(x, 1, 1, periodic=True, manager=manager)
        assert to_numpy(third).__array_interface__["data"][0] != second_address
        assert np.array_equal(to_numpy(third), expected) and np.array_equal(kept, expected[0])
        third_address = to_numpy(third).__array_interface__["data"][0]
        to_numpy(third)[...] = -1
        del third
        fourth = halo_exchange(x, 1, 1, periodic=True, manager=manager)  # dropped: its memory comes back
        assert to_numpy(fourth).__array_interface__["data"][0] == third_address
        assert np.array_equal(to_numpy(fourth), expected)


def _gpu_arrays():
    """CUDA arrays of every installed kind, or [] (then the device tests skip on every rank alike)."""
    makers = []
    try:
        import torch

        if torch.cuda.is_available():
            makers.append(lambda a: torch.from_numpy(a).cuda())
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount():
            makers.append(cupy.asarray)
    except Exception:  # no cupy, no driver or no device
        pass
    return makers


@pytest.mark.parametrize("aware", ["0", "1"])
def test_gpu_arrays_match_the_reference(world, monkeypatch, aware):
    makers = _gpu_arrays()
    if not makers:
        pytest.skip("no CUDA device (torch or cupy)")
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", aware)
    halo.devices.cuda_aware_decision(refresh=True)
    try:
        if halo.devices.cuda_aware_decision().conflict:  # forced direct on an MPI without CUDA support: refused
            with DomainParallelManager(world.size, world.size) as manager:
                for make in makers:
                    with pytest.raises(RuntimeError, match="MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI"):
                        halo_exchange(make(np.ones((2, 4, 3))), 1, -2, manager=manager)
            return
        for make in makers:
            for d, h, periodic, uneven in all_cases(world):
                with DomainParallelManager(world.size, d) as manager:
                    shard, expected = local_case(manager, (2, 3, "N", 5), -2, h, periodic, uneven)
                    x = make(shard)
                    out = halo_exchange(x, h, -2, periodic=periodic, manager=manager)
                    host = out.get() if hasattr(out, "get") else out.cpu().numpy()
                    assert np.array_equal(host, expected)
                    with HaloPlan(x, h, -2, periodic=periodic, manager=manager) as plan:
                        assert plan.transport.name == ("direct" if aware == "1" else "staged")
                        assert np.array_equal(halo.devices.copy_to_host(plan.exchange(out), np.empty(expected.shape, expected.dtype)), expected)
    finally:
        monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
        halo.devices.cuda_aware_decision(refresh=True)


@pytest.mark.parametrize("copy", ["one copy", "pieces of 64 bytes"])
@pytest.mark.parametrize("receive", sorted(RECEIVES))
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_hits_out_and_held_plans_match_the_reference(world, monkeypatch, kind, receive, copy):
    """A call that finds its plan pads exactly: with an interior of one copy through the hit's prepared path
    (halo_call._pad_found); with pieces of 64 bytes (every shard here large) copied in pieces, the halos polled
    between them (torch copies a tensor's); for new results, out= and a held plan."""
    if copy != "one copy":
        monkeypatch.setattr(halo, "_PIECE_BYTES", 64)
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", RECEIVES[receive])
    prepared = []
    original = halo_call._pad_found
    monkeypatch.setattr(halo_call, "_pad_found", lambda *arguments: prepared.append(1) or original(*arguments))
    layouts = {**LAYOUTS, "2d-dim0": (("N", 5), 0)}
    for name, (template, dim) in sorted(layouts.items()):
        for d, h, periodic, uneven in all_cases(world):
            with DomainParallelManager(world.size, d, shard_dim=dim) as manager:
                shard, expected = local_case(manager, template, dim, h, periodic, uneven)
                x = as_kind(shard, kind)
                case = f"{name} D={d} h={h} periodic={periodic} uneven={uneven}"
                for _ in range(3):  # a plan built, then found in the cache (halos sent with the agreement)
                    assert np.array_equal(to_numpy(halo_exchange(x, h, periodic=periodic, manager=manager)), expected), case
                out = as_kind(np.full(expected.shape, -7, shard.dtype), kind)
                assert halo_exchange(x, h, periodic=periodic, manager=manager, out=out) is out
                assert np.array_equal(to_numpy(out), expected), case
                with HaloPlan(x, h, periodic=periodic, manager=manager) as plan:
                    one_copy = plan.pads_in_one_copy
                    if copy == "one copy":
                        assert one_copy, case
                    else:
                        assert len(plan._interior_pieces) > 1 or shard.size * shard.itemsize <= 64, case
                    assert np.array_equal(to_numpy(plan.pad(x)), expected), case
                hits = len(prepared)  # out= is a hit now: the prepared path's if the pad is one copy
                to_numpy(out)[...] = -7
                assert halo_exchange(x, h, periodic=periodic, manager=manager, out=out) is out
                assert np.array_equal(to_numpy(out), expected), case
                assert len(prepared) == hits + one_copy, case
    assert len(prepared) > 0


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_receives_the_result_again_and_again(world, kind):
    with DomainParallelManager(world.size, world.size) as manager:
        for periodic, uneven in ((False, True), (True, False)):
            shard, expected = local_case(manager, (2, "N", 3), 1, 2, periodic, uneven)
            x = as_kind(shard, kind)
            out = as_kind(np.full(expected.shape, -7, shard.dtype), kind)
            for _ in range(3):
                assert halo_exchange(x, 2, 1, periodic=periodic, manager=manager, out=out) is out
                assert np.array_equal(to_numpy(out), expected)
                to_numpy(out)[...] = -7

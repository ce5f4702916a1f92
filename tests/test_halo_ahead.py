"""Halos that leave with the agreement step (a call that finds its plan in the cache).

When every rank agrees, they finish as usual; when the agreement fails (another call, other arguments)
or some rank misses its cache, every rank's started messages are settled before anything raises or
builds anew: a message left in flight would land in a later exchange's ghost rows. Each case changes
the data afterwards, so a stale message would show as wrong rows.
"""

import numpy as np
import pytest

import mpidomain
from mpidomain import _agreement, _mpi, gather_tensor, halo_exchange
from mpidomain.halo import call as halo_call, plan as halo


@pytest.fixture(autouse=True, params=["buffer receives", "datatype receives"])
def receive(request, monkeypatch):
    """Every case with halos received into buffers, and straight into the padded result (rebound to each new one)."""
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", 0 if request.param == "datatype receives" else 1 << 60)
    return request.param


@pytest.fixture
def prepared(monkeypatch):
    """Record what each pad through a hit's prepared path returned (None: the agreement said build anew), or
    "raised"."""
    results = []
    original = halo_call._pad_found

    def recording(*arguments):
        try:
            results.append(original(*arguments))
        except Exception:
            results.append("raised")
            raise
        return results[-1]

    monkeypatch.setattr(halo_call, "_pad_found", recording)
    return results


@pytest.fixture
def manager(world, fresh_manager):
    """The global manager, one domain group of every rank."""
    return mpidomain.initialize_domain_parallel(world.size, world.size, abort_on_error=False)


@pytest.fixture
def settled(monkeypatch):
    """Count the times this rank settled messages started ahead of a failed agreement."""
    calls = []
    original = _agreement._settle_ahead

    def counting(*arguments):
        calls.append(arguments[2])
        return original(*arguments)

    monkeypatch.setattr(_agreement, "_settle_ahead", counting)
    return calls


def shard(world, rows, offset=0.0):
    """This rank's (2, rows, 8) shard of a field whose values name their global row."""
    first = sum(world.allgather(rows)[:world.rank])
    values = np.arange(first, first + rows, dtype=np.float64)[None, :, None] + offset
    return np.broadcast_to(values, (2, rows, 8)).copy()


def padded(world, x, h):
    """The global field (the ranks' shards stacked along dim -2), zero-padded by ``h`` rows, cut to this rank's rows."""
    pieces = world.allgather(x)
    field = np.pad(np.concatenate(pieces, axis=-2), [(0, 0), (h, h), (0, 0)])
    first = sum(p.shape[-2] for p in pieces[:world.rank])
    return field[:, first:first + x.shape[-2] + 2 * h]


def all_true(world, value):
    return world.allreduce(bool(value), op=_mpi.mpi().LAND)


def message_of(call, kind):
    """What ``call`` raised as ``kind`` on this rank, or None."""
    try:
        call()
    except kind as error:
        return str(error)
    return None


def next_exchange_is_exact(world):
    """True if an exchange of new values, on every rank, pads them with the neighbours' new rows."""
    y = shard(world, 4, offset=1000.0)
    return all_true(world, np.array_equal(halo_exchange(y, 1), padded(world, y, 1)))


def needs_two(world):
    if world.size < 2:
        pytest.skip("needs 2 ranks: one rank sends no halo")


def test_a_repeated_call_finishes_what_it_started(manager, world, settled, prepared):
    needs_two(world)
    x = shard(world, 4)
    results = [halo_exchange(x + k, 1) for k in range(3)]  # the first builds; the others go ahead
    assert all_true(world, all(np.array_equal(r, padded(world, x + k, 1)) for k, r in enumerate(results)))
    assert settled == []
    assert all_true(world, len(prepared) == 2 and all(r is not None for r in prepared)), prepared


def test_a_hit_into_out_goes_ahead_and_a_bad_out_raises_on_every_rank(manager, world, settled, prepared):
    needs_two(world)
    x = shard(world, 4)
    out = np.full((2, 6, 8), -7.0)
    for k in range(3):  # the first builds; the others go ahead, into the same out
        assert halo_exchange(x + k, 1, out=out) is out
        assert all_true(world, np.array_equal(out, padded(world, x + k, 1)))
    assert all_true(world, len(prepared) == 2 and settled == [])
    wrong = np.empty((2, 7, 8)) if world.rank == 0 else out  # one rank's out does not fit: no rank goes ahead
    raised = message_of(lambda: halo_exchange(x, 1, out=wrong), ValueError)
    assert all_true(world, raised is not None and "out must be a numpy array" in raised), raised
    assert all_true(world, prepared[2:] == ([] if world.rank == 0 else ["raised"]) and len(settled) == 1), settled
    assert next_exchange_is_exact(world)


def test_another_call_on_one_rank_settles_the_started_halos(manager, world, settled):
    needs_two(world)
    x = shard(world, 4)
    halo_exchange(x, 1)
    # Rank 0 hits: its halos leave with the agreement, which the others meet in gather_tensor.
    raised = message_of(lambda: halo_exchange(x, 1) if world.rank == 0 else gather_tensor(x), RuntimeError)
    assert all_true(world, raised is not None and "different mpidomain calls" in raised), raised
    assert all_true(world, settled == ["halo_exchange"] if world.rank == 0 else settled == ["gather_tensor"])
    assert next_exchange_is_exact(world)


def test_other_arguments_on_one_rank_settle_the_started_halos(manager, world, settled):
    needs_two(world)
    x = shard(world, 4)
    halo_exchange(x, 1)
    raised = message_of(lambda: halo_exchange(x, 2 if world.rank == world.size - 1 else 1), ValueError)
    assert all_true(world, raised is not None and "halo_width must be the same on every rank" in raised), raised
    assert all_true(world, len(settled) == 1)
    assert next_exchange_is_exact(world)


def test_a_miss_on_one_rank_settles_the_others_halos_and_builds_anew(manager, world, settled, prepared):
    needs_two(world)
    x = shard(world, 4)
    halo_exchange(x, 1)
    # The last rank's extent changes (uneven shards are legal): it misses, the others hit and go ahead.
    last = world.rank == world.size - 1
    z = shard(world, 5 if last else 4, offset=500.0)
    assert all_true(world, np.array_equal(halo_exchange(z, 1), padded(world, z, 1)))
    assert all_true(world, len(settled) == 1)
    assert all_true(world, [type(r) for r in prepared] == ([] if last else [type(None)]))  # the hits built anew
    assert next_exchange_is_exact(world)


def test_tensors_in_a_graph_go_ahead_and_settle_alike(manager, world, settled):
    needs_two(world)
    torch = pytest.importorskip("torch")
    x = shard(world, 4)
    for k in range(2):  # the second call goes ahead, in the autograd path too
        t = torch.tensor(x + k, requires_grad=True)
        padded_t = halo_exchange(t, 1)
        padded_t.sum().backward()
        assert all_true(world, np.array_equal(padded_t.detach().numpy(), padded(world, x + k, 1)))
    raised = message_of(lambda: halo_exchange(torch.tensor(x, requires_grad=True), 1 if world.rank else 2), ValueError)
    assert all_true(world, raised is not None and len(settled) == 1), (raised, settled)
    t = torch.tensor(x + 1000.0, requires_grad=True)
    assert all_true(world, np.array_equal(halo_exchange(t, 1).detach().numpy(), padded(world, x + 1000.0, 1)))


def test_a_cached_plan_freed_on_one_rank_is_a_miss_there_and_all_build_anew(manager, world, settled, prepared):
    needs_two(world)
    x = shard(world, 4)
    halo_exchange(x, 1)
    if world.rank == 0:  # the program frees the cached plan on one rank only
        mpidomain.halo.cache.cached_plans(manager)[0].free()
    y = x + 250.0
    assert all_true(world, np.array_equal(halo_exchange(y, 1), padded(world, y, 1)))
    # Rank 0 missed: the others went ahead, settled their halos and built anew with it.
    assert all_true(world, len(settled) == 1)
    assert all_true(world, [type(r) for r in prepared] == ([] if world.rank == 0 else [type(None)]))
    plans = mpidomain.halo.cache.cached_plans(manager)
    assert all_true(world, len(plans) == 1 and not plans[0].freed)
    assert next_exchange_is_exact(world)

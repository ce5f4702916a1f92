"""Halo exchange mistakes: local ones raise with the received value and the fix; a mistake on
one rank raises on every rank of the domain group, listing what each rank had; never a hang."""

import numpy as np
import pytest

from mpidomain import DomainParallelManager, HaloPlan, get_domain_parallel_manager, halo_exchange
from mpidomain.halo import plan as halo


@pytest.fixture
def manager(world):
    with DomainParallelManager(world.size, world.size) as m:
        yield m


def last_rank_only(manager, wrong, right):
    return wrong if manager.domain_rank == manager.domain_parallel_size - 1 else right


def test_needs_a_manager(world):
    assert get_domain_parallel_manager() is None
    with pytest.raises(RuntimeError, match=r"call mpidomain.initialize_domain_parallel\(world_size, domain_parallel_size\) first"):
        halo_exchange(np.zeros((4, 3)), 1)
    with pytest.raises(RuntimeError, match="initialize_domain_parallel"):
        HaloPlan(np.zeros((4, 3)), 1)


@pytest.mark.parametrize("arguments, error, message", [
    (dict(halo_width=-1), ValueError, r"halo_width must be >= 0, got -1"),
    (dict(halo_width=1.5), TypeError, r"halo_width must be an int, got 1.5 \(float\); pass the number of ghost rows"),
    (dict(halo_width=True), TypeError, r"halo_width must be an int, got True \(bool\)"),
    (dict(dim=3), ValueError, r"dim=3 is out of range for a 2-d array of shape \(4, 3\); pass a dim between -2 and 1"),
    (dict(dim="H"), TypeError, r"dim must be an int, got 'H' \(str\)"),
    (dict(periodic="yes"), TypeError, r"periodic must be True or False, got 'yes'"),
    (dict(x=[[1.0, 2.0]]), TypeError, r"expected a NumPy array, CuPy array or Torch tensor, got builtins.list"),
    (dict(x=np.array([["a"], ["b"]], dtype=object)), TypeError, r"unsupported dtype object .*use a bool, integer, float or complex"),
    (dict(x=np.zeros(3, "datetime64[s]")), TypeError, r"unsupported dtype datetime64\[s\]"),
    (dict(x=np.float32(1.0)), TypeError, r"expected a NumPy array"),
])
def test_local_mistakes_on_every_rank(manager, arguments, error, message):
    call = dict(x=np.zeros((4, 3), np.float32), halo_width=1, dim=0, periodic=False)
    call.update(arguments)
    with pytest.raises(error, match=message):
        halo_exchange(call.pop("x"), call.pop("halo_width"), call.pop("dim"), manager=manager, **call)


def test_local_mistake_on_one_rank_raises_everywhere(manager, world):
    x = np.zeros((4, 3), np.float32)
    expected = r"halo_width must be >= 0, got -2" if world.size == 1 else (
        rf"1 of {world.size} ranks rejected the call:\n  rank {world.size - 1}: halo_width must be >= 0, got -2")
    with pytest.raises(ValueError, match=expected):
        halo_exchange(x, last_rank_only(manager, -2, 1), 0, manager=manager)
    with pytest.raises(TypeError, match="expected a NumPy array"):
        halo_exchange(last_rank_only(manager, "oops", x), 1, 0, manager=manager)


def test_disagreements_list_every_rank(manager, world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    last = world.size - 1
    x = np.zeros((4, 3), np.float32)
    cases = [
        (last_rank_only(manager, x.astype(np.float64), x), dict(), TypeError,
         rf"dtype must be the same on every rank of the domain group, got rank 0: float32, .*rank {last}: float64"),
        (last_rank_only(manager, np.zeros((4, 5), np.float32), x), dict(), ValueError,
         rf"other extents must be the same .* got rank 0: \(None, 3\), .*rank {last}: \(None, 5\)"),
        (last_rank_only(manager, np.zeros((4, 3, 1), np.float32), x), dict(), ValueError, r"ndim must be the same"),
        (x, dict(halo_width=last_rank_only(manager, 2, 1)), ValueError,
         rf"halo_width must be the same .* rank 0: 1, .*rank {last}: 2"),
        (x, dict(periodic=last_rank_only(manager, True, False)), ValueError, r"periodic must be the same"),
        (last_rank_only(manager, np.zeros((1, 3), np.float32), x), dict(halo_width=2), ValueError,
         rf"halo_width=2 exceeds the extent along dim on some ranks \(rank 0: 4, .*rank {last}: 1\); every rank must "
         r"hold at least 2 rows"),
    ]
    for array, arguments, error, message in cases:
        call = dict(halo_width=1, periodic=False)
        call.update(arguments)
        with pytest.raises(error, match=message):
            halo_exchange(array, call["halo_width"], 0, periodic=call["periodic"], manager=manager)


def test_torch_disagreements(manager, world):
    torch = pytest.importorskip("torch")
    x = torch.zeros(4, 3)
    other = last_rank_only(manager, np.zeros((4, 3), np.float32), x)
    if world.size == 1:
        assert halo_exchange(other, 1, 0, manager=manager).shape == (6, 3)
        return
    with pytest.raises(TypeError, match=r"array must be the same .* rank 0: torch on host, .*numpy on host"):
        halo_exchange(other, 1, 0, manager=manager)
    with pytest.raises(TypeError, match=r"unsupported torch dtype"):
        halo_exchange(last_rank_only(manager, torch.zeros(4, 3, dtype=torch.uint32), x), 1, 0, manager=manager)


def test_halo_wider_than_a_single_rank(manager):
    with pytest.raises(ValueError, match=r"halo_width=5 exceeds the extent along dim on some ranks \(rank 0: 4"):
        halo_exchange(np.zeros((4, 3)), 5, 0, periodic=True, manager=manager)


def test_plan_misuse(manager, monkeypatch):
    monkeypatch.setattr(halo, "_IN_PLACE_RECEIVE_BYTES", 0)  # receives bound to a C-contiguous array
    x = np.zeros((4, 3), np.float32)
    with HaloPlan(x, 1, 0, manager=manager) as plan:
        with pytest.raises(ValueError, match=r"padded must be a numpy array of shape \(6, 3\) and dtype float32 for "
                                             r"this plan, got a numpy array of shape \(4, 3\) and dtype float32"):
            plan.exchange(x)
        if manager.domain_parallel_size > 1:  # with one rank nothing is received
            with pytest.raises(ValueError, match=r"padded must be C-contiguous for this plan; plan.empty\(\) makes one"):
                plan.exchange(np.zeros((3, 6), np.float32).T)
            with pytest.raises(ValueError, match=r"out must be C-contiguous"):
                plan.pad(x, np.zeros((3, 6), np.float32).T)
        with pytest.raises(ValueError, match=r"x must be a numpy array of shape \(4, 3\)"):
            plan.pad(np.zeros((4, 3)))
        with pytest.raises(RuntimeError, match=r"wait\(\) without start\(\)"):
            plan.wait()
        padded = plan.pad(x)
        plan.start(padded)
        with pytest.raises(RuntimeError, match=r"an exchange is in flight on this plan; call plan.wait\(\) first"):
            plan.start(padded)
        with pytest.raises(RuntimeError, match=r"an exchange is in flight"):
            plan.pad(x)
        plan.wait()
    with pytest.raises(RuntimeError, match="this HaloPlan was freed"):
        plan.pad(x)
    plan.free()  # idempotent


def test_out_mistakes_raise_on_every_rank(manager, world):
    torch = pytest.importorskip("torch")
    x = np.ones((4, 3), np.float32)
    good = np.empty((6, 3), np.float32)
    assert halo_exchange(x, 1, 0, manager=manager, out=good) is good
    wrong = {
        "shape": (np.empty((5, 3), np.float32), ValueError, r"out must be a numpy array on the host of shape \(6, 3\) "
                  r"and dtype float32 \(x with the halos\), got a numpy array of shape \(5, 3\)"),
        "dtype": (np.empty((6, 3)), ValueError, r"and dtype float32 .*got a numpy array of shape \(6, 3\) and dtype float64"),
        "strides": (np.empty((6, 6), np.float32)[:, ::2], ValueError, r"out must be C-contiguous, got strides \(24, 8\)"),
        "kind": (torch.empty(6, 3), ValueError, r"got a torch array of shape \(6, 3\)"),
    }
    for case, (bad, error, message) in wrong.items():
        with pytest.raises(error, match=message):
            halo_exchange(x, 1, 0, manager=manager, out=last_rank_only(manager, bad, good))
    xt = torch.ones(4, 3, requires_grad=True)
    with pytest.raises(TypeError, match="out= cannot take the result of a tensor that requires grad"):
        halo_exchange(xt, 1, 0, manager=manager, out=last_rank_only(manager, torch.empty(6, 3), None))
    assert halo_exchange(x, 1, 0, manager=manager, out=good) is good  # the group is in step afterwards

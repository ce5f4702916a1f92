"""The transport adapter: one decision for every collective, and the same results on each path.

Host arrays stand in for device memory here; the GPU machines run the same
paths on real device memory (tests/test_halo.py's CUDA tests).
"""

import numpy as np
import pytest

from mpidomain import devices, transport
from mpidomain.transport import Transport, transport_for

pytestmark = pytest.mark.one_world  # no MPI: the same in every world

NAMES = ["host", "direct", "staged"]


@pytest.mark.parametrize("device, aware, name", [(False, True, "host"), (True, True, "direct"), (True, False, "staged")])
def test_the_one_decision(monkeypatch, device, aware, name):
    monkeypatch.setattr(devices, "is_device_array", lambda x: device)
    monkeypatch.setattr(devices, "cuda_aware_decision", lambda refresh=False: devices.CudaAwareDecision(aware, "test"))
    chosen = transport_for(np.zeros(3))
    assert chosen.name == name and chosen == Transport(name) and chosen.on_device == device


def test_unknown_transport():
    with pytest.raises(ValueError, match="transport must be 'host', 'direct' or 'staged', got 'gpu'"):
        Transport("gpu")


def kinds():
    makers = [("numpy", lambda a: a)]
    try:
        import torch

        makers.append(("torch", lambda a: torch.from_numpy(a)))
    except ImportError:
        pass
    return makers


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind, make", kinds())
def test_pack_unpack_accumulate(name, kind, make):
    way = Transport(name)
    array = make(np.arange(24, dtype=np.float32).reshape(2, 4, 3))
    view = way.view(array)
    buffer = way.buffer((2, 1, 3), np.dtype(np.float32), like=array)
    way.pack(view[:, 1:2], buffer)
    way.synchronize(array)
    assert np.array_equal(np.asarray(devices.mpi_buffer(buffer)), np.arange(24).reshape(2, 4, 3)[:, 1:2])
    way.unpack(buffer, view[:, 3:4])
    way.after_unpack(array)
    way.accumulate(buffer, array[:, 0:1])
    expected = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    expected[:, 3:4] = expected[:, 1:2]
    expected[:, 0:1] += expected[:, 1:2]
    assert np.array_equal(np.asarray(devices.mpi_buffer(array)), expected)


@pytest.mark.parametrize("name", NAMES)
def test_accumulate_adds_in_the_arrays_dtype(name):
    torch = pytest.importorskip("torch")
    way = Transport(name)
    array = torch.full((2, 3), 1.5, dtype=torch.bfloat16)
    buffer = way.buffer((2, 3), devices.numpy_dtype(array), like=array)
    way.pack(way.view(torch.full((2, 3), 0.25, dtype=torch.bfloat16)), buffer)
    way.accumulate(buffer, array)
    assert torch.equal(array, torch.full((2, 3), 1.75, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", NAMES)
def test_whole_arrays(name):
    way = Transport(name)
    x = np.arange(6, dtype=np.float64)
    scratch = way.staging(x)
    assert (scratch is None) == (name != "staged")
    assert np.array_equal(way.readable(x, scratch), x)
    out = np.zeros(6)
    with way.writable(out, scratch) as memory:
        memory[...] = x * 2
    assert np.array_equal(out, x * 2)
    with way.in_place(out) as memory:
        memory += 1
    assert np.array_equal(out, x * 2 + 1)


def test_every_module_asks_the_one_decision():
    """No module decides host, direct or staged itself: they all call transport_for."""
    import pathlib
    import re

    import mpidomain

    root = pathlib.Path(mpidomain.__file__).parent
    deciders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                      if re.search(r"cuda_aware_decision\(\)\.enabled|decision\.enabled", p.read_text()))
    assert deciders == ["transport.py"], deciders
    assert transport.transport_for.__module__ == "mpidomain.transport"

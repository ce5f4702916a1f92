"""Array kinds, host buffers and the CUDA-aware decision (device paths run where a GPU exists)."""

import numpy as np
import pytest

from mpidomain import devices


def test_array_kinds():
    assert devices.array_kind(np.zeros(3)) == "numpy"
    assert not devices.is_device_array(np.zeros(3))
    with pytest.raises(TypeError, match="expected a NumPy array, CuPy array or Torch tensor, got builtins.list"):
        devices.array_kind([1, 2])


def test_torch_host_buffers_are_views():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32, requires_grad=True).reshape(3, 4)
    assert devices.array_kind(t) == "torch" and not devices.is_device_array(t)
    buf = devices.mpi_buffer(t)
    assert isinstance(buf, np.ndarray) and buf.ctypes.data == t.data_ptr()
    assert devices.numpy_dtype(t) == np.float32
    b = torch.ones(4, dtype=torch.bfloat16)
    assert devices.numpy_dtype(b) == np.uint16
    assert devices.mpi_buffer(b).ctypes.data == b.data_ptr()
    with pytest.raises(TypeError, match="unsupported torch dtype"):
        devices.numpy_dtype(torch.zeros(2, dtype=torch.uint16) if hasattr(torch, "uint16") else torch.zeros(2, dtype=torch.quint8))


def test_host_copies_round_trip():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        src = torch.arange(6).to(dtype).reshape(2, 3)
        host = devices.pinned_empty((2, 3), devices.numpy_dtype(src), like=src)
        devices.copy_to_host(src, host)
        dst = torch.zeros_like(src)
        devices.copy_to_device(host, dst)
        assert torch.equal(src, dst)


@pytest.mark.parametrize("value, enabled", [("1", True), ("on", True), ("0", False), ("no", False)])
def test_cuda_aware_override(monkeypatch, value, enabled):
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", value)
    decision = devices.cuda_aware_decision(refresh=True)
    assert decision.enabled is enabled and f"MPIDOMAIN_CUDA_AWARE={value}" in decision.reason
    monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
    devices.cuda_aware_decision(refresh=True)


def test_cuda_aware_bad_setting(monkeypatch):
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="must be 1, 0 or auto, got 'maybe'"):
        devices.cuda_aware_decision(refresh=True)


def test_cuda_aware_auto_asks_the_library(monkeypatch):
    monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE", raising=False)
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED", raising=False)
    decision = devices.cuda_aware_decision(refresh=True)
    # The PyPI MPICH answers MPIX_GPU_query_support; a CPU-only build says no.
    assert "MPIX_" in decision.reason or "memory kinds" in decision.reason or "cannot tell" in decision.reason
    monkeypatch.setenv("MPICH_GPU_SUPPORT_ENABLED", "1")
    assert devices.cuda_aware_decision(refresh=True).enabled
    monkeypatch.delenv("MPICH_GPU_SUPPORT_ENABLED")
    devices.cuda_aware_decision(refresh=True)

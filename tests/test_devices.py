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


@pytest.mark.parametrize("library, refused", [("MPIX_GPU_query_support(CUDA) = 0", True),
                                               ("MPIX_Query_cuda_support() = 0", True),
                                               ("the MPI library cannot tell; staging to be safe", False)])
def test_forced_direct_on_a_library_without_cuda_is_refused(monkeypatch, library, refused):
    """MPIDOMAIN_CUDA_AWARE=1 where the library says no: a device array raises instead of crashing MPI."""
    from mpidomain import transport

    monkeypatch.setattr(devices, "_probe", lambda: devices.CudaAwareDecision(False, library))
    monkeypatch.setattr(transport.devices, "is_device_array", lambda x: True)  # a host array posing as device memory
    monkeypatch.setenv("MPIDOMAIN_CUDA_AWARE", "1")
    try:
        decision = devices.cuda_aware_decision(refresh=True)
        assert decision.enabled and bool(decision.conflict) is refused
        if refused:
            assert f"but {library}" in str(decision)
            with pytest.raises(RuntimeError, match=r"MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI directly, but "
                                                   r"the MPI library says it has no CUDA support \(MPIX_.*unset "
                                                   r"MPIDOMAIN_CUDA_AWARE"):
                transport.transport_for(np.zeros(3))
        else:
            assert transport.transport_for(np.zeros(3)).name == "direct"
    finally:
        monkeypatch.delenv("MPIDOMAIN_CUDA_AWARE")
        monkeypatch.undo()
        devices.cuda_aware_decision(refresh=True)


def test_empty_assign_and_views_keep_kind_and_memory():
    torch = pytest.importorskip("torch")
    for like in (np.zeros(2, np.float32), torch.zeros(2, dtype=torch.bfloat16)):
        buffer = devices.empty((3, 4), like=like)
        assert devices.array_kind(buffer) == devices.array_kind(like) and buffer.dtype == like.dtype
        assert tuple(buffer.shape) == (3, 4)
        source = torch.arange(12).reshape(3, 4).to(like.dtype) if devices.array_kind(like) == "torch" else \
            np.arange(12, dtype=np.float32).reshape(3, 4)
        devices.assign(buffer[1:], source[:2])
        assert (buffer[1:] == source[:2]).all()
        raw = devices.byte_view(buffer)
        assert raw.dtype in (np.uint8, torch.uint8) and raw.shape[0] == 12 * (2 if like.dtype == torch.bfloat16 else 4)
        host = devices.mpi_buffer(buffer)
        back = devices.from_numpy(host, like=like)
        assert back.dtype == like.dtype and devices.mpi_buffer(back).ctypes.data == host.ctypes.data


def test_array_specs_and_allocation():
    from mpi4py import MPI

    x = np.zeros((2, 3), np.float32)[:, ::2]
    spec = devices.array_spec(x)
    assert spec == devices.ArraySpec("numpy", "float32", "cpu")
    assert devices.empty((4,), spec).dtype == np.float32 and devices.empty((4,), like=x).shape == (4,)
    assert devices.contiguous(x).flags.c_contiguous and not x.flags.c_contiguous
    assert devices.mpi_datatype(x) == MPI.FLOAT
    torch = pytest.importorskip("torch")
    t = torch.zeros(3, 4, dtype=torch.bfloat16).t()
    assert devices.array_spec(t) == devices.ArraySpec("torch", "bfloat16", "cpu")
    assert devices.empty((2,), devices.array_spec(t)).dtype == torch.bfloat16
    assert devices.contiguous(t).is_contiguous() and devices.mpi_datatype(t) == MPI.UNSIGNED_SHORT

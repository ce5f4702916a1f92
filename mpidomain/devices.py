"""Array kinds, devices and CUDA-aware MPI: what MPI may touch directly, and what to stage.

mpidomain moves NumPy arrays, CuPy arrays and Torch tensors. Host memory goes
to MPI as it is. Device memory goes to MPI directly when the MPI library is
CUDA-aware (mpi4py reads ``__cuda_array_interface__`` / DLPack), otherwise it
is staged through pinned host buffers. Neither torch nor cupy is imported
unless an array of theirs is passed in.
"""

import ctypes
import os
import sys
from dataclasses import dataclass

import numpy as np

from ._mpi import mpi

__all__ = [
    "array_kind",
    "is_device_array",
    "numpy_dtype",
    "synchronize",
    "mpi_buffer",
    "pinned_empty",
    "copy_to_host",
    "copy_to_device",
    "ArraySpec",
    "array_spec",
    "empty",
    "contiguous",
    "assign",
    "add_into",
    "byte_view",
    "from_numpy",
    "mpi_datatype",
    "CudaAwareDecision",
    "cuda_aware_decision",
]

_TORCH_TO_NUMPY = {}  # filled on first use: torch.float32 -> np.float32, ...


def array_kind(x):
    """Return ``"numpy"``, ``"torch"`` or ``"cupy"``; raise TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    if module == "torch" and "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):
        torch = sys.modules["torch"]
        if x.layout is not torch.strided:
            raise TypeError(f"expected a dense (strided) Torch tensor, got one of layout {x.layout}; "
                            "convert it first (e.g. x.to_dense())")
        if x.device.type == "meta":
            raise TypeError("expected a Torch tensor with data, got one on the meta device; "
                            "materialise it first (e.g. torch.empty_like(x, device='cpu'))")
        return "torch"
    if module == "cupy" and "cupy" in sys.modules and isinstance(x, sys.modules["cupy"].ndarray):
        return "cupy"
    raise TypeError(
        f"expected a NumPy array, CuPy array or Torch tensor, got {type(x).__module__}.{type(x).__name__}; "
        "convert it first (e.g. numpy.asarray(x))"
    )


def is_device_array(x):
    """Return True if ``x`` lives in GPU memory (a CuPy array or a CUDA tensor)."""
    kind = array_kind(x)
    return kind == "cupy" or (kind == "torch" and x.device.type == "cuda")


def numpy_dtype(x):
    """Return the NumPy dtype matching ``x``'s element type.

    Torch's bfloat16 (no NumPy equivalent) maps to ``uint16``: the same bytes,
    fine for moving data, not for arithmetic reductions.
    """
    kind = array_kind(x)
    if kind != "torch":
        return np.dtype(x.dtype)
    if not _TORCH_TO_NUMPY:
        import torch

        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                     "bool", "complex64", "complex128"):
            _TORCH_TO_NUMPY[getattr(torch, name)] = np.dtype(name)
        _TORCH_TO_NUMPY[torch.bfloat16] = np.dtype("uint16")
    try:
        return _TORCH_TO_NUMPY[x.dtype]
    except KeyError:
        raise TypeError(f"unsupported torch dtype {x.dtype}; use a float, integer, bool or complex tensor") from None


def synchronize(x):
    """Wait for the stream that produces ``x`` so MPI reads finished data (no-op on the host)."""
    kind = array_kind(x)
    if kind == "torch" and x.device.type == "cuda":
        import torch

        torch.cuda.current_stream(x.device).synchronize()
    elif kind == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def host_view(x):
    """Return ``x`` as a NumPy view of its memory, quickly, if it is plain host memory; else None.

    A NumPy array is itself; a strided CPU tensor that needs no grad, not
    bfloat16 nor a lazily conjugated or negated view, is ``x.numpy()``.
    Anything else (device memory, a subclass, ...) gives None: ask
    :func:`mpi_buffer` or :func:`array_kind`.
    """
    if type(x) is np.ndarray:
        return x
    torch = sys.modules.get("torch")
    if torch is not None and type(x) is torch.Tensor and not x.requires_grad:
        try:
            return x.numpy()
        except (RuntimeError, TypeError):  # on a device, bfloat16, sparse, or a lazily conjugated or negated view
            return None
    return None


def mpi_buffer(x):
    """Return an object mpi4py accepts as a buffer for ``x``'s memory (no copy).

    Host arrays become NumPy views; device arrays are passed as they are, for
    a CUDA-aware MPI. ``x`` must be contiguous unless a derived datatype
    describes its layout. A Torch tensor that is a lazy conjugate or
    negative view gives a resolved copy instead, fit for reading only.
    """
    view = host_view(x)
    if view is not None:
        return view
    kind = array_kind(x)
    if kind == "numpy":
        return x
    if kind == "torch":
        x = x.detach().resolve_conj().resolve_neg()  # a copy for lazy conjugate/negative views: read only
        if x.device.type == "cpu":
            if x.dtype == sys.modules["torch"].bfloat16:
                return x.view(sys.modules["torch"].int16).numpy().view(np.uint16)
            return x.numpy()
    return x


def pinned_empty(shape, dtype, like):
    """Return an uninitialised NumPy array in page-locked host memory, for staging ``like``.

    Pinned memory makes device-host copies fast and asynchronous; falls back to
    ordinary memory when ``like`` is a host array.
    """
    kind = array_kind(like)
    if kind == "torch" and like.device.type == "cuda":
        import torch

        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy().view(dtype).reshape(shape)
    if kind == "cupy":
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)
    return np.empty(shape, dtype=dtype)


def copy_to_host(src, dst):
    """Copy device (or host) array ``src`` into host NumPy array ``dst``; returns ``dst``."""
    kind = array_kind(src)
    if kind == "torch":
        import torch

        view = torch.from_numpy(dst)
        if src.dtype == torch.bfloat16:
            view = view.view(torch.bfloat16)
        view.copy_(src.detach())
    elif kind == "cupy":
        if not src.flags.c_contiguous:
            src = src.copy()
        src.get(out=dst)
    else:
        np.copyto(dst, src)
    return dst


def copy_to_device(src, dst):
    """Copy host NumPy array ``src`` into array ``dst`` (device or host) of the same shape."""
    kind = array_kind(dst)
    if kind == "torch":
        import torch

        view = torch.from_numpy(src)
        if dst.dtype == torch.bfloat16:
            view = view.view(torch.bfloat16)
        dst.copy_(view, non_blocking=dst.device.type == "cuda")
    elif kind == "cupy":
        if dst.flags.c_contiguous:
            dst.set(src)
        else:
            dst[...] = sys.modules["cupy"].asarray(src)
    else:
        np.copyto(dst, src)
    return dst


def assign(dst, src):
    """Copy ``src`` into ``dst`` (views welcome); both of the same kind and device. Returns ``dst``."""
    if array_kind(dst) == "torch":
        dst.copy_(src.detach())
    else:
        dst[...] = src
    return dst


def add_into(dst, src):
    """Add ``src`` onto ``dst`` in place (views welcome); both of the same kind and device. Returns ``dst``."""
    if array_kind(dst) == "torch":
        dst.add_(src.detach())
    else:
        dst += src
    return dst


def flip(x, dims):
    """Return ``x`` mirrored along ``dims`` (a view for NumPy and CuPy, a copy for Torch); ``x`` itself if none."""
    if not dims:
        return x
    if array_kind(x) == "torch":
        return x.flip(tuple(dims))
    return (sys.modules["cupy"] if array_kind(x) == "cupy" else np).flip(x, tuple(dims))


def from_numpy(array, like):
    """Return host NumPy ``array`` as an array of ``like``'s kind sharing its memory (CPU Torch or NumPy).

    The inverse of :func:`mpi_buffer` for host arrays; bfloat16 comes back from its uint16 bytes.
    """
    if array_kind(like) != "torch":
        return array
    torch = sys.modules["torch"]
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if like.dtype == torch.bfloat16 else tensor


def byte_view(x):
    """Return C-contiguous ``x`` as a flat uint8 array of the same memory (no copy), for ``MPI.BYTE``.

    Any element type (bfloat16 included) then travels as raw bytes, on the host or the device.
    """
    kind = array_kind(x)
    if kind == "torch":
        return x.detach().reshape(-1).view(sys.modules["torch"].uint8)
    return x.reshape(-1).view(np.uint8)


@dataclass(frozen=True)
class ArraySpec:
    """What an array is, in picklable form, so another rank can allocate its like.

    ``kind`` is ``"numpy"``, ``"torch"`` or ``"cupy"``; ``dtype`` the element
    type's name (``"float32"``, ``"bfloat16"``; ``">f4"`` for a non-native
    byte order); ``device`` ``"cpu"`` or ``"cuda"``.
    """

    kind: str
    dtype: str
    device: str


def array_spec(x):
    """Return the :class:`ArraySpec` of ``x``."""
    kind = array_kind(x)
    if kind == "torch":
        numpy_dtype(x)  # rejects dtypes MPI cannot move
        return ArraySpec(kind, str(x.dtype).replace("torch.", ""), x.device.type)
    dtype = np.dtype(x.dtype)
    # A non-native byte order keeps its spelling ('>f4'): the bytes on the wire are not native floats.
    return ArraySpec(kind, dtype.name if dtype.isnative else dtype.str, "cuda" if kind == "cupy" else "cpu")


def empty(shape, like):
    """Return an uninitialised array of ``shape`` like ``like`` (an array or an :class:`ArraySpec`).

    Same kind and dtype; same device as an array ``like``, or this process's
    current CUDA device for a CUDA :class:`ArraySpec`.
    """
    if isinstance(like, ArraySpec):
        if like.kind == "numpy":
            return np.empty(shape, dtype=like.dtype)
        if like.kind == "cupy":
            import cupy

            return cupy.empty(shape, dtype=like.dtype)
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if like.device == "cuda" else "cpu"
        return torch.empty(shape, dtype=getattr(torch, like.dtype), device=device)
    kind = array_kind(like)
    if kind == "torch":
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=like.dtype)
    return np.empty(shape, dtype=like.dtype)


def contiguous(x):
    """Return ``x`` if MPI can read its memory as C-ordered native values, else such a copy.

    The copy has the same kind, device and shape (0-d stays 0-d); Torch's lazy
    conjugate and negative views are resolved.
    """
    kind = array_kind(x)
    if kind == "torch":
        return x.resolve_conj().resolve_neg().contiguous()
    if x.flags.c_contiguous:
        return x
    return x.copy(order="C")


def mpi_datatype(x):
    """Return the predefined MPI datatype of ``x``'s elements (reductions need predefined types).

    bfloat16 maps to ``MPI_UNSIGNED_SHORT``, as :func:`numpy_dtype` does: fine for moving data only.
    """
    return mpi().Datatype.fromcode(numpy_dtype(x).char)


@dataclass(frozen=True)
class CudaAwareDecision:
    """Whether device buffers go to MPI directly, and why."""

    enabled: bool
    reason: str
    conflict: str = ""  # set when MPIDOMAIN_CUDA_AWARE=1 overrides a library that says it has no CUDA support

    def __str__(self):
        said = f"; but {self.conflict}" if self.conflict else ""
        return f"{'CUDA-aware' if self.enabled else 'staged through host'} ({self.reason}{said})"


_DECISION = None


def _libmpi():
    """Return a ctypes handle on the loaded libmpi that has the MPIX GPU queries, or None."""
    mpi()  # make sure mpi4py has loaded the library
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:  # not Linux
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_GPU_query_support") or hasattr(lib, "MPIX_Query_cuda_support"):
            return lib
    return None


def _probe():
    MPI = mpi()
    if os.environ.get("MPICH_GPU_SUPPORT_ENABLED") == "1":
        return CudaAwareDecision(True, "Cray MPICH with MPICH_GPU_SUPPORT_ENABLED=1")
    try:
        kinds = MPI.COMM_WORLD.Get_info().Get("mpi_memory_alloc_kinds") or ""
    except MPI.Exception:
        kinds = ""
    if "cuda" in kinds:
        return CudaAwareDecision(True, f"MPI reports memory kinds '{kinds}'")
    lib = _libmpi()
    if lib is not None and hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        if lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0:  # 0: MPIX_GPU_SUPPORT_CUDA
            return CudaAwareDecision(bool(supported.value), f"MPIX_GPU_query_support(CUDA) = {supported.value}")
    if lib is not None and hasattr(lib, "MPIX_Query_cuda_support"):
        supported = lib.MPIX_Query_cuda_support()
        return CudaAwareDecision(bool(supported), f"MPIX_Query_cuda_support() = {supported}")
    return CudaAwareDecision(False, "the MPI library cannot tell; staging to be safe (set MPIDOMAIN_CUDA_AWARE=1 to override)")


def cuda_aware_decision(refresh=False):
    """Decide whether to hand device buffers to MPI directly; cached per process.

    ``MPIDOMAIN_CUDA_AWARE=1`` or ``0`` decides; ``auto`` (the default) asks
    the library (MPI-4.1 memory kinds, MPICH's ``MPIX_GPU_query_support``,
    Open MPI's ``MPIX_Query_cuda_support``, Cray's ``MPICH_GPU_SUPPORT_ENABLED``)
    and stages when unsure. Local: ranks may differ only if their environments do.
    """
    global _DECISION
    if _DECISION is not None and not refresh:
        return _DECISION
    setting = os.environ.get("MPIDOMAIN_CUDA_AWARE", "auto").strip().lower()
    if setting in ("1", "true", "yes", "on"):
        library = _probe()
        conflict = library.reason if not library.enabled and library.reason.startswith("MPIX_") else ""
        _DECISION = CudaAwareDecision(True, f"MPIDOMAIN_CUDA_AWARE={setting}", conflict)
    elif setting in ("0", "false", "no", "off"):
        _DECISION = CudaAwareDecision(False, f"MPIDOMAIN_CUDA_AWARE={setting}")
    elif setting == "auto":
        _DECISION = _probe()
    else:
        raise ValueError(f"MPIDOMAIN_CUDA_AWARE must be 1, 0 or auto, got {setting!r}")
    return _DECISION

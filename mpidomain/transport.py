"""How an array's memory reaches MPI: one decision, used by every collective.

- ``host``: host memory (NumPy, CPU Torch) goes to MPI as a NumPy view;
- ``direct``: device memory (CuPy, CUDA Torch) goes to a CUDA-aware MPI as it is;
- ``staged``: device memory is copied through pinned host buffers, for an MPI
  that is not CUDA-aware (:func:`mpidomain.devices.cuda_aware_decision`).

:func:`transport_for` is the only place that decides; halo plans, sharding,
reductions, gradient averaging and ``check`` ask it and then call the same
methods whatever it chose, so no module branches on host versus device.
It is also the one seam for tests that drive the device paths with host arrays.
"""

from contextlib import contextmanager

import numpy as np

from . import devices

__all__ = ["Transport", "transport_for"]


class Transport:
    """The way one kind of array travels through MPI: ``name`` is ``host``, ``direct`` or ``staged``.

    ``on_device`` is True if the arrays live in device memory (direct or staged).
    ``pack(region, buffer)`` copies ``region`` (of a :meth:`view`) into ``buffer`` (of
    :meth:`buffer`), ``unpack(buffer, region)`` back: plain functions, chosen once here, since
    a halo exchange calls them for every block of every call.
    """

    __slots__ = ("name", "on_device", "pack", "unpack")

    def __init__(self, name):
        if name not in ("host", "direct", "staged"):
            raise ValueError(f"transport must be 'host', 'direct' or 'staged', got {name!r}")
        self.name = name
        self.on_device = name != "host"
        self.pack, self.unpack = _COPIES[name]

    @property
    def device_memory_to_mpi(self):
        """True if MPI reads and writes device memory itself (``direct``: a CUDA-aware MPI)."""
        return self.name == "direct"

    @property
    def stages(self):
        """True if device memory travels through pinned host buffers (``staged``)."""
        return self.name == "staged"

    def view(self, array, host=None):
        """Return ``array`` in the form this transport's copies take: a NumPy view of host memory,
        the (detached) device array itself. ``host``: ``array``'s :func:`~mpidomain.devices.host_view`
        if the caller has it already."""
        if self.name == "host":
            return devices.mpi_buffer(array) if host is None else host
        return array.detach() if devices.array_kind(array) == "torch" else array

    def buffer(self, shape, dtype, like):
        """Return a contiguous buffer MPI reads and writes for ``like``'s data: NumPy on the host,
        pinned host memory when staged, device memory when direct. ``dtype`` is a NumPy dtype."""
        if self.name == "host":
            return np.empty(shape, dtype)
        if self.name == "staged":
            return devices.pinned_empty(shape, dtype, like=like)
        return devices.empty(shape, like=like)

    def accumulate(self, buffer, region):
        """Add ``buffer`` onto ``region``, a view of an array of its own kind (not of :meth:`view`:
        the sum is taken in the array's dtype, bfloat16 included)."""
        if self.name == "host":
            update = devices.from_numpy(buffer, like=region)
        elif self.name == "staged":
            update = devices.copy_to_device(buffer, devices.empty(tuple(region.shape), like=region))
        else:
            update = buffer
        devices.add_into(region, update)

    def synchronize(self, array):
        """Wait until device work on ``array``'s stream (packing included) is done, so MPI touches finished data."""
        if self.on_device:
            devices.synchronize(array)

    def after_unpack(self, array):
        """Wait until copies out of pinned buffers are done, so the next transfer may reuse them."""
        if self.name == "staged":
            devices.synchronize(array)

    def staging(self, x):
        """Return a pinned host buffer for all of ``x`` when staged (to pass as ``scratch``), else None."""
        if self.name != "staged":
            return None
        return devices.pinned_empty(tuple(x.shape), devices.numpy_dtype(x), like=x)

    def readable(self, x, scratch=None):
        """Return memory MPI may read for all of contiguous ``x``: a view, or a copy in pinned
        ``scratch`` (default: a new one) when staged."""
        if self.name == "staged":
            return devices.copy_to_host(x, self.staging(x) if scratch is None else scratch)
        self.synchronize(x)
        return devices.mpi_buffer(x)

    @contextmanager
    def writable(self, out, scratch=None):
        """Yield memory MPI may write for all of contiguous ``out``; when staged, pinned ``scratch``
        (default: a new one), copied into ``out`` on exit."""
        if self.name != "staged":
            yield devices.mpi_buffer(out)
            return
        host = self.staging(out) if scratch is None else scratch
        yield host
        devices.copy_to_device(host, out)
        devices.synchronize(out)

    @contextmanager
    def in_place(self, array, scratch=None):
        """Yield memory MPI may read and write for all of contiguous ``array`` (an in-place collective);
        when staged, ``array`` is copied into pinned ``scratch`` (default: a new one) and back on exit."""
        if self.name != "staged":
            self.synchronize(array)
            yield devices.mpi_buffer(array)
            return
        host = self.readable(array, scratch)
        yield host
        devices.copy_to_device(host, array)
        devices.synchronize(array)

    def __eq__(self, other):
        return isinstance(other, Transport) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"Transport({self.name!r})"


def _swapped(copy):
    """``copy(destination, source)`` as ``(source, destination)``."""
    return lambda source, destination: copy(destination, source)


# Each way's pack(region, buffer) and unpack(buffer, region): both copy their first argument into the second.
_COPIES = {"host": (_swapped(np.copyto), _swapped(np.copyto)),
           "staged": (devices.copy_to_host, devices.copy_to_device),
           "direct": (_swapped(devices.assign), _swapped(devices.assign))}

_TRANSPORTS = {name: Transport(name) for name in ("host", "direct", "staged")}


def transport_for(x):
    """Return the :class:`Transport` for array ``x``: host memory, or device memory direct or staged.

    Local: device arrays go direct when :func:`~mpidomain.devices.cuda_aware_decision` says the
    MPI library is CUDA-aware (which depends only on the environment, alike on every rank).
    Raise RuntimeError for a device array when ``MPIDOMAIN_CUDA_AWARE=1`` forces the direct way on
    a library that says it has no CUDA support (it would crash on the device pointer).
    """
    if not devices.is_device_array(x):
        return _TRANSPORTS["host"]
    decision = devices.cuda_aware_decision()
    if decision.enabled and decision.conflict:
        raise RuntimeError(
            f"MPIDOMAIN_CUDA_AWARE=1 hands device memory to MPI directly, but the MPI library says it has no CUDA "
            f"support ({decision.conflict}), and would crash on a device pointer; unset MPIDOMAIN_CUDA_AWARE (or "
            "set it to auto or 0) to stage through host memory, or run with a CUDA-aware MPI build"
        )
    return _TRANSPORTS["direct" if decision.enabled else "staged"]

"""Halo exchange along the sharded dimension: reusable plans and ``halo_exchange``.

Each rank of a domain group holds a slab of a global field along ``dim``;
a stencil (a convolution) on that slab needs ``halo_width`` rows of each
neighbour. A :class:`HaloPlan` is built once per (shape, dtype, device,
halo_width, dim, periodic), PETSc-DMDA style: it validates the inputs across
the domain group, finds the neighbours, and prepares the transfers:

- host memory (NumPy, CPU Torch): the edge rows are packed into contiguous
  buffers and the ghost rows received straight into the padded array through
  MPI subarray datatypes (the fastest mix measured by scripts/bench_halo.py:
  sending from a datatype makes MPI pack far more slowly than one copy does),
  over persistent requests;
- device memory (CuPy, CUDA Torch): the halos are packed into contiguous
  device buffers (derived datatypes on device memory are slow in most MPI
  libraries) and handed to MPI directly when it is CUDA-aware, or staged
  through pinned host buffers otherwise.

Every padded array has ``shape[dim] + 2 * halo_width`` rows along ``dim``:
the neighbours' rows where a neighbour exists, zeros at the outer edges of
the domain group, or the wrapped rows when ``periodic`` (also for one rank,
a local copy, and for two, where both neighbours are the same rank).
CREDIT returns ``x`` unpadded when the domain group has one rank; mpidomain
pads whatever D is, so the code after the exchange never branches on D.
"""

import numbers
import sys
import weakref
from collections import OrderedDict

import numpy as np

from . import devices
from ._mpi import is_active, mpi, raise_on_all_ranks
from .manager import get_domain_parallel_manager

__all__ = ["HaloPlan", "halo_exchange"]

_TO_NEXT = 1  # tag of rows travelling to the next rank (they fill its leading ghost rows)
_TO_PREV = 2  # tag of rows travelling to the previous rank (they fill its trailing ghost rows)
_CACHE_SIZE = 16
_TRANSPORT_OVERRIDE = None  # tests set "packed" or "staged" to run the device paths on host arrays
_NUMBER_KINDS = "biufc"  # bool, signed, unsigned, float, complex

_PLANS = OrderedDict()  # halo_exchange's cache, least recently used first
_LIVE = weakref.WeakSet()  # every plan not yet freed, so a closing manager frees its own
_WATCHED = weakref.WeakSet()  # managers whose close() frees their plans


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _resolve_manager(manager):
    if manager is None:
        manager = get_domain_parallel_manager()
        if manager is None:
            raise RuntimeError(
                "halo exchange needs the domain-parallel manager, and none exists: call "
                "mpidomain.initialize_domain_parallel(world_size, domain_parallel_size) first, "
                "or pass manager="
            )
    if manager.closed:
        raise RuntimeError(f"{manager!r} is closed; initialise a new manager before exchanging halos")
    return manager


def _describe(x, halo_width, dim, periodic):
    """Return what this rank's input looks like; raise TypeError/ValueError for a local mistake."""
    kind = devices.array_kind(x)
    if not _is_int(halo_width):
        raise TypeError(
            f"halo_width must be an int, got {halo_width!r} ({type(halo_width).__name__}); "
            "pass the number of ghost rows on each side, e.g. 1"
        )
    if halo_width < 0:
        raise ValueError(f"halo_width must be >= 0, got {halo_width}; pass the number of ghost rows on each side")
    if not isinstance(periodic, (bool, np.bool_)):
        raise TypeError(f"periodic must be True or False, got {periodic!r} ({type(periodic).__name__})")
    shape = tuple(int(n) for n in x.shape)
    if not shape:
        raise ValueError("x is a 0-d array; halo exchange needs at least the sharded dimension")
    if not _is_int(dim):
        raise TypeError(f"dim must be an int, got {dim!r} ({type(dim).__name__}); e.g. -2 for latitude in (B, C, H, W)")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(
            f"dim={dim} is out of range for a {len(shape)}-d array of shape {shape}; "
            f"use {-len(shape)} <= dim < {len(shape)}"
        )
    dtype = devices.numpy_dtype(x)
    if dtype.kind not in _NUMBER_KINDS:
        raise TypeError(
            f"unsupported dtype {x.dtype} (NumPy kind {dtype.kind!r}); halo exchange moves numbers: "
            "use a bool, integer, float or complex array"
        )
    dim = int(dim) % len(shape)
    return {
        "array": f"{kind} on {'device' if devices.is_device_array(x) else 'host'}",
        "dtype": str(x.dtype),
        "ndim": len(shape),
        "dim": dim,
        "other extents": shape[:dim] + (None,) + shape[dim + 1:],
        "halo_width": int(halo_width),
        "periodic": bool(periodic),
        "extent": shape[dim],
    }


def _check_group(comm, mine):
    """Raise on every rank unless the domain group's inputs fit together; collective over ``comm``."""
    everyone = comm.allgather(mine)
    problems = []
    for field in ("array", "dtype", "ndim", "dim", "other extents", "halo_width", "periodic"):
        values = [e[field] for e in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            problems.append(f"{field} must be the same on every rank of the domain group, got {listing}")
    if not problems:
        extents = [e["extent"] for e in everyone]
        width = mine["halo_width"]
        if min(extents) < width:
            listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(extents))
            problems.append(
                f"halo_width={width} exceeds the extent along dim on some ranks ({listing}); every rank "
                f"must hold at least {width} rows: use a smaller halo_width or fewer domain ranks"
            )
    if problems:
        kind = TypeError if problems[0].startswith(("array", "dtype")) else ValueError
        raise kind("halo exchange inputs disagree across the domain group:\n  " + "\n  ".join(problems))


def _choose_transport(x):
    if _TRANSPORT_OVERRIDE is not None:
        return _TRANSPORT_OVERRIDE
    if not devices.is_device_array(x):
        return "host"
    return "packed" if devices.cuda_aware_decision().enabled else "staged"


def _zero(view):
    if devices.array_kind(view) == "torch":
        view.zero_()
    else:
        view[...] = 0


def _add_into(view, update):
    if devices.array_kind(view) == "torch":
        view.add_(update)
    else:
        view += update


class HaloPlan:
    """Exchange the halo rows of one kind of padded array, again and again.

    Collective over the domain group: build it on every rank of the group with
    arrays of the same dtype, device kind and extents except along ``dim``
    (extents may differ there: 721 rows over 4 ranks is 181/180/180/180). A
    mismatch, or a rank holding fewer than ``halo_width`` rows, raises the same
    ValueError or TypeError on every rank, listing what each rank had.

    Padded arrays have ``plan.padded_shape``: ``halo_width`` ghost rows, the
    local rows (``plan.interior(padded)``), then ``halo_width`` ghost rows.
    :meth:`exchange`, :meth:`start`, :meth:`wait`, :meth:`pad` and
    :meth:`adjoint` are collective too: all ranks of the group call them in the
    same order. Free the plan with :meth:`free` or a ``with`` block; closing
    the manager frees it as well.

    :param x: This rank's unpadded shard (an example: shape, dtype and device count).
    :param halo_width: Ghost rows on each side.
    :param dim: Sharded dimension; default ``manager.shard_dim``.
    :param periodic: Wrap around the domain group's ends instead of padding with zeros.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, x, halo_width, dim=None, *, periodic=False, manager=None):
        manager = _resolve_manager(manager)
        comm = manager.domain_comm
        if dim is None:
            dim = manager.shard_dim
        mine, error = None, None
        try:
            mine = _describe(x, halo_width, dim, periodic)
        except (TypeError, ValueError) as exc:
            error = exc
        raise_on_all_ranks(comm, error)
        _check_group(comm, mine)

        self.manager = manager
        self.kind = devices.array_kind(x)
        self.dtype = x.dtype
        self.shape = tuple(int(n) for n in x.shape)
        self.dim = mine["dim"]
        self.halo_width = h = mine["halo_width"]
        self.periodic = mine["periodic"]
        n = self.shape[self.dim]
        self.padded_shape = self.shape[:self.dim] + (n + 2 * h,) + self.shape[self.dim + 1:]
        self.transport = _choose_transport(x)
        self._device = devices.is_device_array(x)
        self._itemsize = devices.numpy_dtype(x).itemsize
        self._like = devices.empty((0,), like=x)  # allocates padded arrays and buffers of x's kind

        size, rank = comm.Get_size(), comm.Get_rank()
        prev_rank = rank - 1 if rank > 0 else (size - 1 if self.periodic else None)
        next_rank = rank + 1 if rank < size - 1 else (0 if self.periodic else None)
        self.neighbors = (prev_rank, next_rank)  # ranks of manager.domain_comm

        top, first, last, bottom = self._rows(0, h), self._rows(h, 2 * h), self._rows(n, n + h), self._rows(n + h, n + 2 * h)
        self._interior = self._rows(h, n + h)
        self._sends, self._recvs, self._copies, self._zeros = [], [], [], []
        if h and int(np.prod(self.padded_shape)):
            if size == 1 and self.periodic:
                self._copies = [(last, top), (first, bottom)]  # (source rows, ghost rows)
            else:
                if prev_rank is None:
                    self._zeros.append(top)
                else:
                    self._sends.append((prev_rank, _TO_PREV, first))
                    self._recvs.append((prev_rank, _TO_NEXT, top))
                if next_rank is None:
                    self._zeros.append(bottom)
                else:
                    self._sends.append((next_rank, _TO_NEXT, last))
                    self._recvs.append((next_rank, _TO_PREV, bottom))

        MPI = mpi()
        self._comm = comm.Dup()  # halo traffic never meets any other message
        self._datatypes = {}
        self._recv_requests = []
        self._bound = None  # (pointer, array) the host path's receive requests point into
        self._in_flight = None
        self._adjoint_buffers = None
        self._spare = None  # the last padded host array pad() returned, reused once the program drops it
        self._freed = False
        self._send_buffers = [self._buffer(x) for _ in self._sends]
        self._send_requests = [self._comm.Send_init(self._mpi_message(MPI, buf), dest=peer, tag=tag)
                               for (peer, tag, _), buf in zip(self._sends, self._send_buffers)]
        if self.transport == "host":
            for _, _, rows in self._recvs:
                self._datatypes[rows[-1].start] = self._subarray(MPI, rows[-1].start)
        else:
            self._recv_buffers = [self._buffer(x) for _ in self._recvs]
            self._recv_requests = [self._comm.Recv_init(self._mpi_message(MPI, buf), source=peer, tag=tag)
                                   for (peer, tag, _), buf in zip(self._recvs, self._recv_buffers)]
        self._requests = self._recv_requests + self._send_requests
        _LIVE.add(self)
        if manager not in _WATCHED:
            _WATCHED.add(manager)
            manager._add_close_callback(_release_plans_of)

    # -- layout -------------------------------------------------------------
    def _rows(self, start, stop):
        return (slice(None),) * self.dim + (slice(start, stop),)

    def _halo_shape(self):
        return self.shape[:self.dim] + (self.halo_width,) + self.shape[self.dim + 1:]

    def _subarray(self, MPI, start):
        """Return the committed datatype of ``halo_width`` rows from ``start`` in a padded array."""
        outer = int(np.prod(self.padded_shape[:self.dim]))
        inner = int(np.prod(self.padded_shape[self.dim + 1:])) * self._itemsize
        rows = self.padded_shape[self.dim]
        return MPI.BYTE.Create_subarray([outer, rows, inner], [outer, self.halo_width, inner], [0, start, 0]).Commit()

    def _buffer(self, like):
        if self.transport == "host":
            return np.empty(self._halo_shape(), devices.numpy_dtype(like))
        if self.transport == "staged":
            return devices.pinned_empty(self._halo_shape(), devices.numpy_dtype(like), like=like)
        return devices.empty(self._halo_shape(), like=like)

    def _mpi_message(self, MPI, buffer):
        return [devices.mpi_buffer(devices.byte_view(buffer)), MPI.BYTE]

    def interior(self, padded):
        """Return the view of ``padded``'s local rows (everything but the ghost rows)."""
        return padded[self._interior]

    def empty(self):
        """Return a new uninitialised padded array on the plan's device (local, not collective)."""
        self._check_usable()
        return devices.empty(self.padded_shape, like=self._like)

    # -- checks -------------------------------------------------------------
    def _check_usable(self):
        if self._freed:
            raise RuntimeError("this HaloPlan was freed (by free(), its manager's close() or halo_exchange's cache); build a new one")

    def _check_array(self, array, shape, what):
        kind = devices.array_kind(array)
        if kind != self.kind or tuple(array.shape) != shape or array.dtype != self.dtype:
            raise ValueError(
                f"{what} must be a {self.kind} array of shape {shape} and dtype {self.dtype} for this plan, got "
                f"a {kind} array of shape {tuple(array.shape)} and dtype {array.dtype}; build a plan for it"
            )
        if devices.is_device_array(array) != self._device:
            raise ValueError(f"{what} is on another device than the plan's; build a plan for it")

    def _host_view(self, padded, what="padded"):
        view = devices.mpi_buffer(padded)
        if not view.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous for this plan; pass a contiguous array (plan.empty() makes one)")
        return view

    # -- the forward exchange -------------------------------------------------
    def _fill_local(self, array):
        """Zero the ghost rows at the domain's outer edges; copy the wrapped rows when D=1 and periodic."""
        for rows in self._zeros:
            _zero(array[rows])
        for source, ghost in self._copies:
            devices.assign(array[ghost], array[source])

    def start(self, padded):
        """Start refreshing ``padded``'s ghost rows in place; return at once.

        Collective over the domain group. The local rows may be read, and
        other arrays computed, until :meth:`wait`; neither the ghost rows nor
        the edge rows being sent may be written before it returns.
        """
        self._check_usable()
        if self._in_flight is not None:
            raise RuntimeError("start() called twice without wait(); call plan.wait() first")
        self._check_array(padded, self.padded_shape, "padded")
        working = padded.detach() if self.kind == "torch" else padded
        if self.transport == "host":
            view = self._host_view(working)
            self._fill_local(view)
            for (_, _, rows), buffer in zip(self._sends, self._send_buffers):
                np.copyto(buffer, view[rows])
            if self._bound is None or self._bound[0] != view.ctypes.data:
                self._bind(view)
        else:
            self._fill_local(working)
            self._pack(working)
        if self._requests:
            mpi().Prequest.Startall(self._requests)
        self._in_flight = (padded, working)

    def wait(self):
        """Finish the exchange :meth:`start` began; return the padded array."""
        if self._in_flight is None:
            raise RuntimeError("wait() without start(); call plan.start(padded) first")
        (padded, working), self._in_flight = self._in_flight, None
        if self._requests:
            mpi().Request.Waitall(self._requests)
        if self.transport != "host":
            self._unpack(working)
        return padded

    def exchange(self, padded):
        """Refresh the ghost rows of ``padded`` in place (``start`` then ``wait``); return it.

        Collective over the domain group: every rank passes its padded array
        of ``plan.padded_shape``. The local rows are not copied.
        """
        self.start(padded)
        return self.wait()

    def pad(self, x, out=None):
        """Return ``x`` with ghost rows on both sides along ``dim``, in ``out`` or a new array.

        Collective over the domain group: every rank passes its shard. Copies
        ``x`` into the interior once and receives the ghost rows in place.
        """
        self._check_usable()
        self._check_array(x, self.shape, "x")
        if out is None:
            out = self._new_padded()
        else:
            self._check_array(out, self.padded_shape, "out")
        if self.transport != "host":
            devices.assign(out[self._interior], x)
            return self.exchange(out)
        if self._in_flight is not None:
            raise RuntimeError("pad() while an exchange is in flight; call plan.wait() first")
        view, source = self._host_view(out, "out"), devices.mpi_buffer(x)
        if self._sends:
            # Send x's edge rows first, so they travel while the interior is copied. A new
            # array each call: a plain receive on the cached datatype costs less than binding
            # a persistent one to it (scripts/bench_halo.py measures both).
            MPI = mpi()
            for (_, _, rows), buffer in zip(self._sends, self._send_buffers):
                np.copyto(buffer, source[self._shifted(rows)])
            comm, types = self._comm, self._datatypes
            requests = [comm.Irecv([view, 1, types[rows[-1].start]], source=peer, tag=tag)
                        for peer, tag, rows in self._recvs]
            MPI.Prequest.Startall(self._send_requests)
            view[self._interior] = source
            self._fill_local(view)
            MPI.Request.Waitall(requests + self._send_requests)
        else:
            view[self._interior] = source
            self._fill_local(view)
        return out

    def _new_padded(self):
        """Return a padded array for :meth:`pad`: on the host, last call's if the program dropped it.

        Reusing it spares the page faults of a fresh allocation (most of the cost of
        padding a large shard); only the plan holding it is proof that nobody else does.
        """
        if self._device:
            return devices.empty(self.padded_shape, like=self._like)
        spare = self._spare
        if spare is None or sys.getrefcount(spare) > 3:  # held by self._spare, `spare` and the call only
            spare = self._spare = np.empty(self.padded_shape, devices.numpy_dtype(self._like))
        return devices.from_numpy(spare, like=self._like)

    def _bind(self, view):
        """Point the persistent receive requests at host array ``view`` (the host path)."""
        self._free_requests(self._recv_requests)
        comm, types = self._comm, self._datatypes
        self._recv_requests = [comm.Recv_init([view, 1, types[rows[-1].start]], source=peer, tag=tag)
                               for peer, tag, rows in self._recvs]
        self._requests = self._recv_requests + self._send_requests
        self._bound = (view.ctypes.data, view)

    def _pack(self, padded):
        for (_, _, rows), buffer in zip(self._sends, self._send_buffers):
            if self.transport == "staged":
                devices.copy_to_host(padded[rows], buffer)
            else:
                devices.assign(buffer, padded[rows])
        devices.synchronize(padded)  # MPI must read finished data

    def _unpack(self, padded):
        for (_, _, rows), buffer in zip(self._recvs, self._recv_buffers):
            if self.transport == "staged":
                devices.copy_to_device(buffer, padded[rows])
            else:
                devices.assign(padded[rows], buffer)
        if self.transport == "staged":
            devices.synchronize(padded)  # the next exchange reuses the pinned buffers

    # -- the adjoint (backward) ---------------------------------------------------
    def adjoint(self, grad):
        """Return the gradient of the unpadded shard, given ``grad`` of the padded array.

        The exact adjoint of :meth:`pad`: the interior rows of ``grad``, plus
        each ghost row's gradient sent back to the rank that owns the row and
        added onto it (wrapped rows too; ghost rows of zeros get nothing).
        Collective over the domain group. ``grad`` is not modified.
        """
        self._check_usable()
        self._check_array(grad, self.padded_shape, "grad")
        if self._in_flight is not None:
            raise RuntimeError("adjoint() while an exchange is in flight; call plan.wait() first")
        if self.kind == "torch":
            grad = grad.detach().contiguous()
        elif self.kind == "numpy":
            grad = np.ascontiguousarray(grad)
        else:
            import cupy

            grad = cupy.ascontiguousarray(grad)
        h = self.halo_width
        out = devices.empty(self.shape, like=grad)
        devices.assign(out, grad[self._interior])
        for source, ghost in self._copies:
            _add_into(out[self._shifted(source)], grad[ghost])
        if not self._sends:
            return out
        MPI = mpi()
        comm = self._comm
        if self._adjoint_buffers is None:
            self._adjoint_buffers = [self._buffer(grad) if self.transport == "staged"
                                     else devices.empty(self._halo_shape(), like=grad) for _ in self._sends]
        # Ghost rows go back where they came from: the reverse of each forward message, same tag.
        if self.transport == "host":
            view = self._host_view(grad, "grad")
            outgoing = [[view, 1, self._datatypes[rows[-1].start]] for _, _, rows in self._recvs]
        else:
            for (_, _, rows), buffer in zip(self._recvs, self._recv_buffers):
                if self.transport == "staged":
                    devices.copy_to_host(grad[rows], buffer)
                else:
                    devices.assign(buffer, grad[rows])
            devices.synchronize(grad)
            outgoing = [self._mpi_message(MPI, buffer) for buffer in self._recv_buffers]
        requests = [comm.Irecv(self._mpi_message(MPI, buffer), source=peer, tag=tag)
                    for (peer, tag, _), buffer in zip(self._sends, self._adjoint_buffers)]
        requests += [comm.Isend(message, dest=peer, tag=tag)
                     for (peer, tag, _), message in zip(self._recvs, outgoing)]
        MPI.Request.Waitall(requests)
        for (_, _, rows), buffer in zip(self._sends, self._adjoint_buffers):
            if self.transport == "staged":
                buffer = devices.copy_to_device(buffer, devices.empty(self._halo_shape(), like=grad))
            _add_into(out[self._shifted(rows)], buffer)
        if self.transport == "staged":
            devices.synchronize(grad)
        return out

    def _shifted(self, rows):
        """Rows of the padded array, as rows of the unpadded shard."""
        span = rows[-1]
        return self._rows(span.start - self.halo_width, span.stop - self.halo_width)

    # -- lifetime -------------------------------------------------------------
    def live_handles(self):
        """Return how many MPI requests, datatypes and communicators the plan holds (0s once freed)."""
        MPI = mpi()
        return {
            "requests": sum(r != MPI.REQUEST_NULL for r in self._requests),
            "datatypes": sum(t != MPI.DATATYPE_NULL for t in self._datatypes.values()),
            "communicators": int(self._comm != MPI.COMM_NULL),
        }

    def _free_requests(self, requests):
        for request in requests:
            if request != mpi().REQUEST_NULL:
                request.Free()
        self._bound = None

    def free(self):
        """Release the plan's MPI requests, datatypes, communicator and buffers; idempotent.

        Collective over the domain group (it frees a communicator). Finishes
        an exchange still in flight first.
        """
        if self._freed:
            return
        if self._in_flight is not None and is_active():
            self.wait()
        self._freed = True
        _LIVE.discard(self)
        if is_active():
            self._free_requests(self._requests)
            for datatype in self._datatypes.values():
                datatype.Free()
            self._comm.Free()
        self._requests, self._recv_requests, self._send_requests = [], [], []
        self._send_buffers = self._recv_buffers = self._adjoint_buffers = self._like = self._spare = None

    @property
    def freed(self):
        """True once :meth:`free` released the plan."""
        return self._freed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def __repr__(self):
        state = "freed" if self._freed else f"neighbors={self.neighbors}, transport={self.transport}"
        return (f"HaloPlan(shape={self.shape}, dtype={self.dtype}, halo_width={self.halo_width}, "
                f"dim={self.dim}, periodic={self.periodic}, {state})")


def _release_plans_of(manager):
    """Free every plan of ``manager`` (its close() calls this)."""
    for key in [k for k, plan in _PLANS.items() if plan.manager is manager]:
        del _PLANS[key]
    for plan in [p for p in _LIVE if p.manager is manager]:
        plan.free()


def cached_plan(x, halo_width, dim=None, *, periodic=False, manager=None):
    """Return the cached :class:`HaloPlan` for ``x``'s shard, building it on a miss.

    Collective over the domain group on a miss (all ranks miss together when
    they call with the same sequence of arguments). Keeps the last 16 plans;
    an evicted plan is freed.
    """
    manager = _resolve_manager(manager)
    try:
        key = (manager, devices.array_kind(x), str(x.dtype), str(getattr(x, "device", "cpu")), tuple(x.shape),
               halo_width, dim, periodic, _TRANSPORT_OVERRIDE)
        plan = _PLANS.get(key)
    except TypeError:  # not an array, or an unhashable argument: the plan build reports it on every rank
        key = plan = None
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    plan = HaloPlan(x, halo_width, dim, periodic=periodic, manager=manager)
    _PLANS[key] = plan
    while len(_PLANS) > _CACHE_SIZE:
        _PLANS.popitem(last=False)[1].free()
    return plan


def halo_exchange(x, halo_width, dim=None, *, periodic=False, manager=None):
    """Return ``x`` padded with ``halo_width`` of its neighbours' rows on both sides along ``dim``.

    Collective over the domain group: call on every rank of the group, each
    with its own shard (same dtype, device kind and extents except along
    ``dim``), the same ``halo_width``, ``dim`` and ``periodic``. Each rank
    gets a new array of ``x``'s kind, dtype and device with
    ``x.shape[dim] + 2 * halo_width`` rows along ``dim``: the previous rank's
    last rows, ``x``, the next rank's first rows; zeros at the ends of the
    domain group, or the rows from the other end when ``periodic=True``. The
    result has that shape for any D, one rank included (CREDIT returns ``x``
    unpadded when D=1).

    :param x: This rank's shard: NumPy array, CuPy array or Torch tensor.
    :param halo_width: Ghost rows on each side (<= every rank's extent along ``dim``).
    :param dim: Sharded dimension; default ``manager.shard_dim``.
    :param periodic: Wrap around the ends of the domain group.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """
    return cached_plan(x, halo_width, dim, periodic=periodic, manager=manager).pad(x)

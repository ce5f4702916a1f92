"""Halo exchange along the sharded dimension: reusable plans and ``halo_exchange``.

Each rank of a domain group holds a slab of a global field along ``dim``;
a stencil (a convolution) on that slab needs ``halo_width`` rows of each
neighbour. A :class:`HaloPlan` is built once per (shape, dtype, device,
halo_width, dim, periodic), PETSc-DMDA style: it validates the inputs across
the domain group, finds the neighbours, and prepares the transfers:

- host memory (NumPy, CPU Torch): the edge rows are packed into contiguous
  NumPy buffers and sent; large halos are received straight into the padded
  array through MPI subarray datatypes, small ones into contiguous buffers
  and copied; persistent requests. scripts/bench_halo.py measures the
  alternatives: with MPICH, sending through a datatype costs more than one
  NumPy copy;
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

import weakref
from collections import OrderedDict

import numpy as np

from . import devices
from ._mpi import agree, is_active, mpi
from ._validate import normalize_dim, require_int, require_manager
from .manager import allocate_tags, library_comm

__all__ = ["HaloPlan", "halo_exchange"]

# Each plan gets two tags of its manager (allocate_tags): the first for rows travelling to the
# next rank (they fill its leading ghost rows), the second for rows travelling to the previous one.
_CACHE_SIZE = 16
# Host halos at least this large arrive straight in the padded array through a subarray datatype;
# smaller ones in a contiguous buffer, then one copy. With MPICH on shared memory the datatype
# saves the copy of a 1 MB halo but costs more than copying a 16 KB one (scripts/bench_halo.py).
_IN_PLACE_RECEIVE_BYTES = 256 * 1024
_NUMBER_KINDS = "biufc"  # bool, signed, unsigned, float, complex

_CACHES = weakref.WeakKeyDictionary()  # manager -> halo_exchange's plans, least recently used first
_LIVE = weakref.WeakSet()  # every plan not yet freed, so a closing manager frees its own
_WATCHED = weakref.WeakSet()  # managers whose close() frees their plans


def _describe(x, halo_width, dim, periodic):
    """Return what this rank's input looks like; raise TypeError/ValueError for a local mistake."""
    kind = devices.array_kind(x)
    require_int("halo_width", halo_width, least=0, hint="pass the number of ghost rows on each side, e.g. 1")
    if not isinstance(periodic, (bool, np.bool_)):
        raise TypeError(f"periodic must be True or False, got {periodic!r} ({type(periodic).__name__})")
    shape = tuple(int(n) for n in x.shape)
    if not shape:
        raise ValueError("x is a 0-d array; halo exchange needs at least the sharded dimension")
    dim = normalize_dim(dim, shape)
    dtype = devices.numpy_dtype(x)
    if dtype.kind not in _NUMBER_KINDS:
        raise TypeError(
            f"unsupported dtype {x.dtype} (NumPy kind {dtype.kind!r}); halo exchange moves numbers: "
            "use a bool, integer, float or complex array"
        )
    return {
        "array": f"{kind} on {'device' if devices.is_device_array(x) else 'host'}",
        "dtype": x.dtype,
        "ndim": len(shape),
        "dim": dim,
        "other extents": shape[:dim] + (None,) + shape[dim + 1:],
        "halo_width": int(halo_width),
        "periodic": bool(periodic),
        "extent": shape[dim],
    }


def _signature(mine):
    """What every rank of the group must pass alike: the description less the extent along dim."""
    return None if mine is None else {f: v for f, v in mine.items() if f != "extent"}


def _group_mismatch(everyone):
    """Return the TypeError/ValueError for the ranks' differing :func:`_signature` dicts."""
    problems = []
    for field in everyone[0]:
        values = [e[field] for e in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            problems.append(f"{field} must be the same on every rank of the domain group, got {listing}")
    kind = TypeError if problems[0].startswith(("array", "dtype", "call")) else ValueError
    return kind("halo exchange inputs disagree across the domain group:\n  " + "\n  ".join(problems))


def _agree_inputs(comm, call, mine, error, flag=False, token=0):
    """Agree on the ranks' inputs (one Allreduce) for ``call``; return ``flag`` set on any rank, or raise on all.

    Also True where the ranks' int ``token`` differ.
    """
    return agree(comm, call, _signature(mine), flag, error, _group_mismatch, token)


def _check_extents(comm, mine):
    """Raise ValueError on every rank unless every rank holds at least ``halo_width`` rows; collective."""
    extents = comm.allgather(mine["extent"])
    width = mine["halo_width"]
    if min(extents) < width:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(extents))
        raise ValueError(
            f"halo_width={width} exceeds the extent along dim on some ranks ({listing}); every rank "
            f"must hold at least {width} rows: use a smaller halo_width or fewer domain ranks"
        )


def _choose_transport(x):
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

    :param x: This rank's unpadded shard, or any array of its shape, dtype and device.
    :param halo_width: Ghost rows on each side.
    :param dim: Sharded dimension; default ``manager.shard_dim``.
    :param periodic: Wrap around the domain group's ends instead of padding with zeros.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, x, halo_width, dim=None, *, periodic=False, manager=None):
        manager = require_manager(manager, "halo exchange")
        comm = library_comm(manager)
        if dim is None:
            dim = manager.shard_dim
        mine, error = None, None
        try:
            mine = _describe(x, halo_width, dim, periodic)
        except (TypeError, ValueError) as exc:
            error = exc
        _agree_inputs(comm, "HaloPlan", mine, error)
        _check_extents(comm, mine)

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
        self._numpy_dtype = devices.numpy_dtype(x)
        self._like = devices.empty((0,), like=x)  # allocates padded arrays and buffers of x's kind

        size, rank = comm.Get_size(), comm.Get_rank()
        # Along a dimension the group does not shard, every rank holds all of it: pad locally.
        self.sharded = _is_sharded(manager, self.dim, len(self.shape))
        if not self.sharded:
            size, rank = 1, 0
        prev_rank = rank - 1 if rank > 0 else (size - 1 if self.periodic else None)
        next_rank = rank + 1 if rank < size - 1 else (0 if self.periodic else None)
        self.neighbors = (prev_rank, next_rank)  # ranks of manager.domain_comm
        self.tag = to_next = allocate_tags(manager, 2)  # the same on every rank: names the plan
        to_prev = to_next + 1

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
                    self._sends.append((prev_rank, to_prev, first))
                    self._recvs.append((prev_rank, to_next, top))
                if next_rank is None:
                    self._zeros.append(bottom)
                else:
                    self._sends.append((next_rank, to_next, last))
                    self._recvs.append((next_rank, to_prev, bottom))

        MPI = mpi()
        self._comm = comm  # the manager's private duplicate: no user message can match a halo
        self._in_flight = None
        self._freed = False
        self._send_rows = [rows for _, _, rows in self._sends]
        self._recv_rows = [rows for _, _, rows in self._recvs]
        self._send_rows_of_shard = [self._shifted(rows) for rows in self._send_rows]
        # Halos leave from contiguous buffers. Large host halos arrive straight in the padded
        # array through subarray datatypes (persistent receives bound to its address, rebound
        # when another array comes); the others arrive in contiguous buffers too.
        halo_bytes = int(np.prod(self._halo_shape())) * self._numpy_dtype.itemsize
        self._receive_in_place = self.transport == "host" and halo_bytes >= _IN_PLACE_RECEIVE_BYTES
        self._send_buffers = [self._buffer(x) for _ in self._sends]
        self._send_requests = [self._comm.Send_init(self._mpi_message(MPI, buffer), dest=peer, tag=tag)
                               for (peer, tag, _), buffer in zip(self._sends, self._send_buffers)]
        self._recv_buffers = [self._buffer(x) for _ in self._recvs]
        self._recv_types = [self._subarray(MPI, rows) for rows in self._recv_rows] if self._receive_in_place else []
        self._bound_address = None
        self._recv_requests = [] if self._receive_in_place else [
            self._comm.Recv_init(self._mpi_message(MPI, buffer), source=peer, tag=tag)
            for (peer, tag, _), buffer in zip(self._recvs, self._recv_buffers)]
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

    def _subarray(self, MPI, rows):
        """The committed datatype of ``rows`` (a slice along ``dim``) of a C-contiguous padded array."""
        outer = int(np.prod(self.padded_shape[:self.dim]))
        inner = int(np.prod(self.padded_shape[self.dim + 1:])) * self._numpy_dtype.itemsize
        sizes = [outer, self.padded_shape[self.dim], inner]
        start = rows[-1].start
        return MPI.BYTE.Create_subarray(sizes, [outer, self.halo_width, inner], [0, start, 0]).Commit()

    def _bind_receives(self, view):
        """Point the persistent receives at C-contiguous host array ``view`` (a no-op if they do).

        Only the address is kept: a request is started only while an array of the
        plan's padded shape lives there, so it never writes to memory the program freed.
        """
        address = view.ctypes.data
        if address == self._bound_address:
            return
        for request in self._recv_requests:
            request.Free()
        memory = mpi().buffer.fromaddress(address, view.nbytes)  # holds no reference to the array
        self._recv_requests = [self._comm.Recv_init([memory, 1, datatype], source=peer, tag=tag)
                               for (peer, tag, _), datatype in zip(self._recvs, self._recv_types)]
        self._requests = self._recv_requests + self._send_requests
        self._bound_address = address

    def _buffer(self, like):
        """A contiguous buffer for one halo: NumPy on the host, pinned host memory or device memory."""
        if self.transport == "host":
            return np.empty(self._halo_shape(), self._numpy_dtype)
        if self.transport == "staged":
            return devices.pinned_empty(self._halo_shape(), self._numpy_dtype, like=like)
        return devices.empty(self._halo_shape(), like=like)

    def _mpi_message(self, MPI, buffer):
        return [devices.mpi_buffer(devices.byte_view(buffer)), MPI.BYTE]

    def _shifted(self, rows):
        """Rows of the padded array, as rows of the unpadded shard."""
        span = rows[-1]
        return self._rows(span.start - self.halo_width, span.stop - self.halo_width)

    def interior(self, padded):
        """Return the view of ``padded``'s local rows (everything but the ghost rows)."""
        return padded[self._interior]

    def empty(self):
        """Return a new uninitialised padded array on the plan's device (local, not collective)."""
        if self._freed:
            self._check_usable()
        return devices.empty(self.padded_shape, like=self._like)

    # -- checks -------------------------------------------------------------
    def _check_usable(self):
        if self._freed:
            raise RuntimeError("this HaloPlan was freed (by free(), its manager's close() or halo_exchange's cache); build a new one")
        if self._in_flight is not None:
            raise RuntimeError("an exchange is in flight on this plan; call plan.wait() first")

    def _check_array(self, array, shape, what):
        kind = devices.array_kind(array)
        if kind != self.kind or tuple(array.shape) != shape or array.dtype != self.dtype:
            raise ValueError(
                f"{what} must be a {self.kind} array of shape {shape} and dtype {self.dtype} for this plan, got "
                f"a {kind} array of shape {tuple(array.shape)} and dtype {array.dtype}; build a plan for it"
            )
        if kind != "numpy" and devices.is_device_array(array) != self._device:
            raise ValueError(f"{what} is on another device than the plan's; build a plan for it")
        if what != "x" and kind == "torch" and (array.is_conj() or array.is_neg()):
            raise ValueError(f"{what} is a lazily conjugated or negated view, which cannot be written in place; "
                             "pass a plain tensor (e.g. plan.empty())")

    def _working(self, array):
        """The array the transfers touch: a NumPy view of host memory, the device array itself."""
        return devices.mpi_buffer(array) if self.transport == "host" else (
            array.detach() if self.kind == "torch" else array)

    # -- moving halos ---------------------------------------------------------
    def _fill_local(self, array):
        """Zero the ghost rows at the domain's outer edges; copy the wrapped rows when D=1 and periodic."""
        for rows in self._zeros:
            _zero(array[rows])
        for source, ghost in self._copies:
            devices.assign(array[ghost], array[source])

    def _pack(self, array, regions, buffers):
        """Copy ``regions`` of ``array`` into contiguous ``buffers``, ready for MPI."""
        for rows, buffer in zip(regions, buffers):
            if self.transport == "staged":
                devices.copy_to_host(array[rows], buffer)
            else:
                devices.assign(buffer, array[rows])
        if self._device:
            devices.synchronize(array)  # MPI must read finished data

    def _unpack(self, buffers, array, regions):
        """Copy contiguous ``buffers`` into ``regions`` of ``array``."""
        for buffer, rows in zip(buffers, regions):
            if self.transport == "staged":
                devices.copy_to_device(buffer, array[rows])
            else:
                devices.assign(array[rows], buffer)
        if self.transport == "staged":
            devices.synchronize(array)  # the next exchange reuses the pinned buffers

    # -- the forward exchange -------------------------------------------------
    def start(self, padded):
        """Start refreshing ``padded``'s ghost rows in place; return at once.

        Collective over the domain group. The local rows may be read, and
        other arrays computed, until :meth:`wait`; the ghost rows may not be
        touched before it returns.
        """
        self._check_usable()
        self._check_array(padded, self.padded_shape, "padded")
        working = self._working(padded)
        if self.transport == "host":
            self._fill_local_host(working)
            for rows, buffer in zip(self._send_rows, self._send_buffers):
                np.copyto(buffer, working[rows])
            if self._receive_in_place and self._recvs:
                if not working.flags.c_contiguous:
                    raise ValueError("padded must be C-contiguous for this plan; plan.empty() makes one")
                self._bind_receives(working)
        else:
            self._fill_local(working)
            self._pack(working, self._send_rows, self._send_buffers)
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
        if not self._receive_in_place:
            self._unpack(self._recv_buffers, working, self._recv_rows)
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

        Collective over the domain group: every rank passes its shard. The
        halos travel first, then ``x`` is copied into the interior once.
        """
        self._check_usable()
        self._check_array(x, self.shape, "x")
        if out is not None:
            self._check_array(out, self.padded_shape, "out")
        if self.transport == "host":
            return self._pad_host(x, out)
        if out is None:
            out = devices.empty(self.padded_shape, like=x)
        source, working = self._working(x), self._working(out)
        self._pack(source, self._send_rows_of_shard, self._send_buffers)
        if self._requests:
            MPI = mpi()
            MPI.Prequest.Startall(self._requests)
            MPI.Request.Waitall(self._requests)
        devices.assign(working[self._interior], source)
        self._fill_local(working)
        self._unpack(self._recv_buffers, working, self._recv_rows)
        return out

    def _pad_host(self, x, out):
        """:meth:`pad` on the host, in NumPy operations only (the hot path)."""
        source = x if self.kind == "numpy" else devices.mpi_buffer(x)
        if out is None:
            padded = np.empty(self.padded_shape, self._numpy_dtype)
            out = padded if self.kind == "numpy" else devices.from_numpy(padded, like=self._like)
        else:
            padded = devices.mpi_buffer(out)
        for rows, buffer in zip(self._send_rows_of_shard, self._send_buffers):
            np.copyto(buffer, source[rows])
        if self._requests:
            if self._receive_in_place:
                if not padded.flags.c_contiguous:
                    raise ValueError("out must be C-contiguous for this plan; plan.empty() makes one")
                self._bind_receives(padded)
            MPI = mpi()
            MPI.Prequest.Startall(self._requests)
            MPI.Request.Waitall(self._requests)
        padded[self._interior] = source
        self._fill_local_host(padded)
        if not self._receive_in_place:
            for buffer, rows in zip(self._recv_buffers, self._recv_rows):
                padded[rows] = buffer
        return out

    def _fill_local_host(self, padded):
        """:meth:`_fill_local` for a NumPy array."""
        for rows in self._zeros:
            padded[rows] = 0
        for rows, ghost in self._copies:
            padded[ghost] = padded[rows]

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
        if self.kind == "torch":
            grad = grad.detach()
        out = devices.empty(self.shape, like=grad)
        devices.assign(out, grad[self._interior])
        for source, ghost in self._copies:
            _add_into(out[self._shifted(source)], grad[ghost])
        if not self._requests:
            return out
        # Each forward message in reverse, same tag: the ghost rows' gradients (packed into
        # the forward receive buffers) go back to their owners, arriving in the send buffers.
        MPI = mpi()
        self._pack(self._working(grad), self._recv_rows, self._recv_buffers)
        requests = [self._comm.Irecv(self._mpi_message(MPI, buffer), source=peer, tag=tag)
                    for (peer, tag, _), buffer in zip(self._sends, self._send_buffers)]
        requests += [self._comm.Isend(self._mpi_message(MPI, buffer), dest=peer, tag=tag)
                     for (peer, tag, _), buffer in zip(self._recvs, self._recv_buffers)]
        MPI.Request.Waitall(requests)
        for (_, _, rows), buffer in zip(self._sends, self._send_buffers):
            if self.transport == "staged":
                buffer = devices.copy_to_device(buffer, devices.empty(self._halo_shape(), like=grad))
            elif self.transport == "host":
                buffer = devices.from_numpy(buffer, like=grad)
            _add_into(out[self._shifted(rows)], buffer)
        if self._device:
            devices.synchronize(grad)  # the next exchange reuses the buffers
        return out

    # -- lifetime -------------------------------------------------------------
    def live_handles(self):
        """Return how many MPI requests and datatypes the plan holds (0s once freed).

        A plan owns no communicator: it uses its manager's private one.
        """
        MPI = mpi()
        if self._freed:
            return {"requests": 0, "datatypes": 0}
        return {
            "requests": sum(r != MPI.REQUEST_NULL for r in self._requests),
            "datatypes": sum(t != MPI.DATATYPE_NULL for t in self._recv_types),
        }

    def free(self):
        """Release the plan's MPI requests, datatypes and buffers; idempotent and local.

        Finishes an exchange still in flight first (which needs the other
        ranks to take part in it). A plan the program drops unfreed is
        released the same way when it is garbage-collected.
        """
        if self._freed:
            return
        if self._in_flight is not None and is_active():
            self.wait()
        self._release()

    def _release(self):
        self._freed = True
        _LIVE.discard(self)
        if is_active():
            for request in self._requests:
                if request != mpi().REQUEST_NULL:
                    request.Free()
            for datatype in self._recv_types:
                datatype.Free()
        self._requests, self._recv_types = [], []
        self._send_buffers = self._recv_buffers = self._like = None

    def __del__(self):
        # Local handles only, so safe at any time; a plan dropped mid-exchange keeps its
        # requests (freeing an active request would let MPI write into freed memory).
        if not getattr(self, "_freed", True) and getattr(self, "_in_flight", None) is None:
            self._release()

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


def _is_sharded(manager, dim, ndim):
    """True if normalised ``dim`` of an ``ndim``-d array is the one ``manager`` shards."""
    shard_dim = manager.shard_dim
    return -ndim <= shard_dim < ndim and dim == shard_dim % ndim


def _release_plans_of(manager):
    """Free every plan of ``manager`` (its close() calls this)."""
    _CACHES.pop(manager, None)
    for plan in [p for p in _LIVE if p.manager is manager]:
        plan.free()


def cached_plan(x, halo_width, dim=None, *, periodic=False, manager=None, call="pad"):
    """Return the cached :class:`HaloPlan` for ``x``'s shard, building it on a miss.

    Collective over the domain group, on every call: one small agreement step
    checks that every rank passed the same arguments (all but the extent along
    ``dim``) for the same ``call`` (``"pad"``, ``"pad+grad"``, ``"adjoint"``)
    and settles hit or miss for all ranks at once: if any rank misses, all
    build a new plan together. A disagreement raises on every rank, listing
    what each rank had. Each manager keeps its own last 16 plans.
    """
    manager = require_manager(manager, "halo exchange")
    comm = library_comm(manager)
    mine, error, key = None, None, None
    try:
        mine = _describe(x, halo_width, manager.shard_dim if dim is None else dim, periodic)
        kind = devices.array_kind(x)
        device = str(x.device) if kind == "torch" else x.device.id if kind == "cupy" else None
        key = (tuple(mine.values()), device)  # this rank's plan; the call kind does not change it
        mine["call"] = call
    except (TypeError, ValueError) as exc:
        error = exc
    cache = _CACHES.setdefault(manager, OrderedDict())
    plan = cache.get(key)
    # A hit counts only if every rank hit the same plan, the one built together with the same tags:
    # after uneven shards, one rank's key can find a plan its neighbour has since replaced.
    miss = _agree_inputs(comm, "halo_exchange", mine, error, flag=plan is None,
                         token=-1 if plan is None else plan.tag)
    if not miss:
        cache.move_to_end(key)
        return plan
    del mine["call"]
    plan = HaloPlan(x, halo_width, dim, periodic=periodic, manager=manager)
    old = cache.pop(key, None)
    if old is not None:
        old.free()
    cache[key] = plan
    while len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)[1].free()
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
    unpadded when D=1). Along a dimension the manager does not shard (e.g.
    longitude, ``dim=-1``, of a latitude-sharded field) each rank holds the
    whole extent, so the result is a local pad of ``x``: its own wrapped rows
    with ``periodic=True``, zeros otherwise. Every call starts with one small
    agreement step (an Allreduce) that checks the ranks' arguments and settles
    the plan cache alike on every rank; a mismatch raises on every rank. A
    Torch tensor that requires grad goes through :class:`mpidomain.nn.HaloExchange`.

    :param x: This rank's shard: NumPy array, CuPy array or Torch tensor.
    :param halo_width: Ghost rows on each side (<= every rank's extent along ``dim``).
    :param dim: Sharded dimension; default ``manager.shard_dim``.
    :param periodic: Wrap around the ends of the domain group.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """
    if getattr(x, "requires_grad", False) is True:  # a Torch tensor in an autograd graph
        from .nn.halo import HaloExchange

        return HaloExchange(halo_width, dim, periodic, manager=manager)(x)
    return cached_plan(x, halo_width, dim, periodic=periodic, manager=manager).pad(x)

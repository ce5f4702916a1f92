"""Halo exchange along the sharded dimension: reusable plans (``halo_exchange`` is :mod:`mpidomain.halo.call`'s).

Each rank of a domain group holds a slab of a global field along ``dim``;
a stencil (a convolution) on that slab needs ``halo_width`` rows of each
neighbour. A :class:`HaloPlan` is built once per (shape, dtype, device,
halo_width, dim, periodic), PETSc-DMDA style: it validates the inputs across
the domain group, finds the neighbours, and prepares the transfers:

- host memory (NumPy, CPU Torch): the edge rows are packed into contiguous
  NumPy buffers and sent; large halos are received straight into the padded
  array through MPI subarray datatypes, small ones into contiguous buffers
  and copied; persistent requests. scripts/bench/bench_halo.py measures the
  alternatives: with MPICH, sending through a datatype costs more than one
  NumPy copy;
- device memory (CuPy, CUDA Torch): the halos are packed into contiguous
  device buffers (derived datatypes on device memory are slow in most MPI
  libraries) and handed to MPI directly when it is CUDA-aware, or staged
  through pinned host buffers otherwise.

Every plan is a :class:`~mpidomain.layout.tiles.TileLayout`'s (a slab is a
grid of tiles with one sharded dim): on a 2-D decomposition (latitude x
longitude tiles), along several dims at once, or with ``boundary="earth"``,
every block of the padded tile (edges and corners) comes from the rank that
holds it, one message per peer (its blocks packed together), mirrored across
the poles for the Earth.

Every padded array has ``shape[dim] + 2 * halo_width`` rows along ``dim``:
the neighbours' rows where a neighbour exists, zeros at the outer edges of
the domain group, or the wrapped rows when ``periodic`` (also for one rank,
a local copy, and for two, where both neighbours are the same rank).
CREDIT returns ``x`` unpadded when the domain group has one rank; mpidomain
pads whatever D is, so the code after the exchange never branches on D.
"""

import dataclasses
import math
import sys
from typing import NamedTuple

import numpy as np

from .. import comm_stats, devices, transport
from . import cache as plan_cache
from .._datatypes import block_shape, message, struct_of_blocks
from .._exit import stands_down_at_exit
from .._mpi import is_active, mpi
from .._waits import wait_all
from .._agreement import agree
from .._current import require_manager
from .spec import check_tiles, describe, group_mismatch
from ..layout.tiles import TileLayout

__all__ = ["HaloPlan", "PadStart"]

# Host halos at least this large arrive straight in the padded array through a subarray datatype;
# smaller ones in a contiguous buffer, then one copy. With MPICH on shared memory the datatype
# saves the copy of a 1 MB halo but costs more than copying a 16 KB one (scripts/bench/bench_halo.py).
_IN_PLACE_RECEIVE_BYTES = 256 * 1024

# A host interior is copied into the padded result in pieces of about this size, the halos polled between
# them (they move only while the ranks poll, so they travel during the copy); host tensors at least this
# large are copied by torch, smaller ones by NumPy (scripts/bench/bench_halo.py: where the rows of a NumPy and a
# torch allocation are aligned differently, torch's copy_ is the faster; NumPy's costs less per call).
_PIECE_BYTES = 4 << 20


@stands_down_at_exit
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
    same order (so are :meth:`from_spec`, :meth:`start_pad`, :meth:`finish_pad` and
    :meth:`pad_prepared`, ``halo_exchange``'s, whose agreement step settles what they
    take for granted). Free the plan with :meth:`free` or a ``with`` block; closing
    the manager frees it as well. ``plan.layout`` (a
    :class:`~mpidomain.layout.tiles.TileLayout`) says which rows go where;
    ``plan.transport`` how they reach MPI; ``plan.pads_in_one_copy`` whether a pad copies
    the shard in one NumPy copy (a host shard under 4 MiB). ``plan.dim``, ``plan.halo_width``
    and ``plan.periodic`` are the arguments, normalised (one value per padded
    dim, the value itself along one dim); ``plan.neighbors`` the ``(previous,
    next)`` rank along each padded dim (a pair along one dim), None at an edge
    that is not periodic.

    With tiles (a manager of ``(D_lat, D_lon)``) or ``boundary="earth"``, the
    halos are padded along each of the dims (default: the manager's
    ``shard_dims``; ``(-2, -1)`` with the Earth), corners included, and
    ``halo_width`` and ``periodic`` may be one value or one per dim; the tiles
    of a row (or column) of the grid must share their extent, as
    ``shard_tensor`` cuts them.

    :param x: This rank's unpadded shard, or any array of its shape, dtype and device.
    :param halo_width: Ghost rows on each side (an int, or one per dim).
    :param dim: Sharded dimension, or a tuple of dims; default ``manager.shard_dim``.
    :param periodic: Wrap around the domain group's ends instead of padding with zeros (or one per dim).
    :param boundary: ``None``, or ``"earth"``: longitude (dim -1) periodic, and beyond each pole
        (dim -2) the rows on the near side of it, mirrored, half a turn of longitude away; equal to
        CREDIT's ``TensorPadding(mode="earth")`` on the global field, cut to the tile.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, x, halo_width, dim=None, *, periodic=False, boundary=None, manager=None):
        manager = require_manager(manager, "halo exchange")
        comm = manager.library_comm()
        mine, error = None, None
        try:
            mine = describe(x, halo_width, dim, periodic, manager, boundary)
        except (TypeError, ValueError) as exc:
            error = exc
        agree(comm, "HaloPlan", None if mine is None else mine.signature(), error=error, mismatch=group_mismatch)
        self._build(x, mine, manager, comm, "HaloPlan")

    @classmethod
    def from_spec(cls, x, spec, manager, call):
        """Build a plan for ``x`` from the :class:`~mpidomain.halo.spec.HaloSpec` ``spec`` the ranks agreed on already.

        Collective like the constructor (the extents are still gathered), without its agreement step.
        """
        plan = cls.__new__(cls)
        plan._build(x, spec, manager, manager.library_comm(), call)
        return plan

    def _build(self, x, mine, manager, comm, call):
        """The constructor's work once the ranks agree on :class:`~mpidomain.halo.spec.HaloSpec` ``mine``: the layout, buffers and
        requests."""
        self.manager = manager
        self.kind = devices.array_kind(x)
        self.dtype = x.dtype
        self.shape = tuple(int(n) for n in x.shape)
        self.boundary = mine.boundary
        # The call's dim, halo_width and periodic, normalised: one value per padded dim (one dim: the value).
        self.dim, self.halo_width, self.periodic = mine.arguments()
        extents, coords = check_tiles(comm, mine, manager, call)
        layout = TileLayout(self.shape, mine.dims, mine.widths, mine.modes, extents, coords)
        # Tags the same on every rank, as many as the most blocks one rank takes from another: they name
        # the plan (halo_exchange's cache agrees on them).
        layout = dataclasses.replace(layout, tag=manager.allocate_tags(max(layout.tags, 1)))
        self.layout = layout
        self.tag, self.padded_shape = layout.tag, layout.padded_shape
        # (previous, next) rank along each padded dim (one dim: the pair), None at an edge that is not periodic.
        pairs = tuple(layout.neighbors_along(mine.dims.index(d)) for d in mine.exchanged)
        self.neighbors = pairs[0] if len(pairs) == 1 else pairs
        self.transport = transport.transport_for(x)
        self._comm = comm  # the manager's private duplicate: no user message can match a halo
        self._device = devices.is_device_array(x)
        self._like = devices.empty((0,), like=x)  # allocates padded arrays of x's kind and device
        like = self._like
        self._wrap = (lambda array: array) if self.kind == "numpy" else (lambda array: devices.from_numpy(array, like))
        if self.kind == "torch" and not self._device and x.dtype is not sys.modules["torch"].bfloat16:
            self._wrap = sys.modules["torch"].from_numpy  # a host array of x's kind from NumPy memory
        self._in_flight = None
        self._freed = False
        self._interior = layout.interior
        # One message per peer and direction: the layout's blocks for that peer, in tag order.
        self._sends, self._receives = _bundles(layout.sends), _bundles(layout.receives)
        self._zeros, self._copies = layout.zeros, layout.copies
        # Halos leave from contiguous buffers. Large host halos arrive straight in the padded
        # array through subarray datatypes (persistent receives bound to its address, rebound
        # when another array comes); the others arrive in contiguous buffers too.
        self._numpy_dtype = dtype = devices.numpy_dtype(x)
        # The interior's pieces and who copies them (see _PIECE_BYTES); one piece on a device.
        nbytes = math.prod(self.shape) * dtype.itemsize
        self._torch_copies_interior = self.kind == "torch" and not self._device and nbytes >= _PIECE_BYTES
        self._interior_pieces = layout.interior_pieces(1 if self._device else -(-nbytes // _PIECE_BYTES))
        # A host pad whose interior is one NumPy copy: halo_exchange's hits take pad_prepared.
        self.pads_in_one_copy = (not self.transport.on_device and len(self._interior_pieces) == 1
                                 and not self._torch_copies_interior)
        padded = self.padded_shape
        smallest = min((_elements(padded, b) for b in self._receives), default=0)
        self._receive_in_place = not self.transport.on_device and smallest * dtype.itemsize >= _IN_PLACE_RECEIVE_BYTES
        self._send_buffers = [self.transport.buffer((_elements(padded, b),), dtype, x) for b in self._sends]
        self._recv_buffers = [self.transport.buffer((_elements(padded, b),), dtype, x) for b in self._receives]
        self._send_views = [_views(buffer, padded, b) for buffer, b in zip(self._send_buffers, self._sends)]
        self._recv_views = [_views(buffer, padded, b) for buffer, b in zip(self._recv_buffers, self._receives)]
        # Each block as (where it is read, mirrored along, buffer view): from a shard (pad) or a padded array (exchange).
        sent = [(m, view) for bundle, views in zip(self._sends, self._send_views) for m, view in zip(bundle.blocks, views)]
        self._packs_of_shard = [(layout.shard_rows(m.rows), m.flip, view) for m, view in sent]
        self._packs_of_padded = [(m.rows, m.flip, view) for m, view in sent]
        # Each received block as (buffer view, ghost rows), unless it arrives in place.
        self._unpacks = [(view, m.rows) for bundle, views in zip(self._receives, self._recv_views)
                         for m, view in zip(bundle.blocks, views)]
        self._send_requests = [comm.Send_init(message(buffer), dest=m.peer, tag=m.tag)
                               for m, buffer in zip(self._sends, self._send_buffers)]
        self._recv_types = [struct_of_blocks(padded, dtype.itemsize, [m.rows for m in b.blocks]) for b in self._receives] \
            if self._receive_in_place else []
        self._bound_address = None
        self._recv_requests = [] if self._receive_in_place else [
            comm.Recv_init(message(buffer), source=m.peer, tag=m.tag)
            for m, buffer in zip(self._receives, self._recv_buffers)]
        self._requests = self._recv_requests + self._send_requests
        self._messages = None
        plan_cache.register(self)

    def _started_messages(self):
        """Return (sends, receives): ``(peer, tag, request)`` of each transfer :meth:`_begin` starts."""
        if self._messages is None or self._messages[0] is not self._recv_requests:  # receives rebound
            self._messages = (self._recv_requests,
                              [(m.peer, m.tag, r) for m, r in zip(self._sends, self._send_requests)],
                              [(m.peer, m.tag, r) for m, r in zip(self._receives, self._recv_requests)])
        return self._messages[1], self._messages[2]

    def interior(self, padded):
        """Return the view of ``padded``'s local rows (everything but the ghost rows)."""
        return padded[self._interior]

    def empty(self):
        """Return a new uninitialised padded array on the plan's device (local, not collective)."""
        if self._freed:
            self._check_usable()
        return devices.empty(self.padded_shape, like=self._like)

    def _new_padded(self):
        """Return a new padded array and its :meth:`Transport.view`; on the host NumPy allocates it for both
        kinds (freed memory is reused at once), and the NumPy array is the view."""
        if self.transport.on_device:
            out = devices.empty(self.padded_shape, like=self._like)
            return out, self.transport.view(out)
        working = np.empty(self.padded_shape, self._numpy_dtype)
        return self._wrap(working), working

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
        if what in ("padded", "out"):
            if kind == "torch" and (array.is_conj() or array.is_neg()):
                raise ValueError(f"{what} is a lazily conjugated or negated view, which cannot be written in place; "
                                 "pass a plain tensor (e.g. plan.empty())")
            if self._receive_in_place and self._receives and not devices.mpi_buffer(array).flags.c_contiguous:
                raise ValueError(f"{what} must be C-contiguous for this plan; plan.empty() makes one")

    # -- moving halos ---------------------------------------------------------
    def _begin(self, source, packs, working):
        """Pack ``source``'s blocks listed in ``packs`` (``_packs_of_shard`` or ``_packs_of_padded``); start the
        transfers that fill ``working``'s ghost rows."""
        pack = self.transport.pack
        for region, flip, view in packs:
            pack(devices.flip(source[region], flip) if flip else source[region], view)
        self.transport.synchronize(source)  # MPI must read finished data
        if self._receive_in_place and self._receives:
            self._bind_receives(working)
        if self._requests:
            if comm_stats.recorder is not None:
                comm_stats.sent("halo", sum(buffer.nbytes for buffer in self._send_buffers))
            mpi().Prequest.Startall(self._requests)

    def _finish(self, working):
        """Wait for the transfers; fill ``working``'s ghost rows."""
        self._wait_transfers()
        self._fill_ghosts(working)

    def _copies_first(self, fresh):
        """Whether a pad copies its interior before it waits for the halos: a large ``fresh`` result (allocated
        for this call), whose pages are first touched, and mapped, by the copy in order rather than by the
        receives all over it."""
        return fresh and len(self._interior_pieces) > 1

    def _copy_interior(self, x, out, source, working, poll):
        """Copy ``x`` into the interior piece by piece; with ``poll``, poll the halos between the pieces (they
        move only while the ranks poll); return whether some are still in flight."""
        pending = poll
        if self._torch_copies_interior:
            x = x.detach()
        for padded_index, tile_index in self._interior_pieces:
            if pending:
                pending = not mpi().Request.Testall(self._requests)
            if self._torch_copies_interior:
                out[padded_index].copy_(x[tile_index])
            else:
                working[padded_index] = source[tile_index]
        return pending

    def _complete(self, x, out, source, working, fresh, copied=False):
        """Finish a pad begun by :meth:`_begin`: copy ``x`` into the interior (unless ``copied``), fill the
        ghost rows.

        The halos are waited for before a copy in one piece, and polled between the pieces of a larger one
        into an ``out`` the caller passed; a large ``fresh`` result is copied first (:meth:`_copies_first`)."""
        pending = bool(self._requests)
        if not copied:
            if pending and len(self._interior_pieces) == 1:
                self._wait_transfers()
                pending = False
            self._copy_interior(x, out, source, working, pending and not self._copies_first(fresh))
        if pending:
            self._wait_transfers()
        self._fill_ghosts(working)

    def _wait_transfers(self):
        if self._requests:
            wait_all(self._requests, comm=self._comm, call="halo exchange",
                     awaiting=lambda: _awaiting(self._receives, self._sends))

    def _fill_ghosts(self, working):
        """Fill ``working``'s ghost rows that are not messages or did not arrive in place."""
        for rows in self._zeros:
            working[rows] = 0
        for source, ghost, flip in self._copies:
            working[ghost] = devices.flip(working[source], flip)
        if self._unpacks and not self._receive_in_place:
            unpack = self.transport.unpack
            for view, rows in self._unpacks:
                unpack(view, working[rows])
            self.transport.after_unpack(working)  # the next exchange reuses the staging buffers

    def _bind_receives(self, view):
        """Point the persistent receives at C-contiguous host array ``view`` (a no-op if they do; checked by _check_array).

        Only the address is kept: a request is started only while an array of the
        plan's padded shape lives there, so it never writes to memory the program freed.
        """
        address = view.ctypes.data
        if address == self._bound_address:
            return
        for request in self._recv_requests:
            request.Free()
        memory = mpi().buffer.fromaddress(address, view.nbytes)  # holds no reference to the array
        self._recv_requests = [self._comm.Recv_init([memory, 1, datatype], source=m.peer, tag=m.tag)
                               for m, datatype in zip(self._receives, self._recv_types)]
        self._requests = self._recv_requests + self._send_requests
        self._bound_address = address

    def start(self, padded):
        """Start refreshing ``padded``'s ghost rows in place; return at once.

        Collective over the domain group. The local rows may be read, and
        other arrays computed, until :meth:`wait`; the ghost rows may not be
        touched before it returns.
        """
        self._check_usable()
        self._check_array(padded, self.padded_shape, "padded")
        working = self.transport.view(padded)
        self._begin(working, self._packs_of_padded, working)
        self._in_flight = (padded, working)

    def wait(self):
        """Finish the exchange :meth:`start` began; return the padded array."""
        if self._in_flight is None:
            raise RuntimeError("wait() without start(); call plan.start(padded) first")
        (padded, working), self._in_flight = self._in_flight, None
        self._finish(working)
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
        halos are packed and sent, then ``x`` is copied into the interior (once)
        once they arrived.
        """
        self._check_usable()
        self._check_array(x, self.shape, "x")
        if out is not None:
            self._check_array(out, self.padded_shape, "out")
        fresh = out is None
        if fresh:
            out, working = self._new_padded()
        else:
            working = self.transport.view(out)
        source = self.transport.view(x)
        self._begin(source, self._packs_of_shard, working)
        self._complete(x, out, source, working, fresh)
        return out

    # -- a halo_exchange call that found the plan in its cache (halo/call.py) ---------------
    def start_pad(self, x, host, out, agreement, messages):
        """Prepare ``x``'s padded result and, if ``agreement.ahead``, start its halos; return a :class:`PadStart`.

        ``host``: ``x``'s :func:`~mpidomain.devices.host_view`, or None; ``out``: where the result goes (None: a new
        array). The halos started are listed in ``messages`` (:class:`~mpidomain._agreement.AheadMessages`).
        Finish with :meth:`finish_pad`. Not checked: ``x`` and ``out`` must suit the plan.
        """
        fresh = out is None
        if fresh:
            out, working = self._new_padded()
        else:
            working = self.transport.view(out)
        source = self.transport.view(x, host)
        if not agreement.ahead:
            return PadStart(out, source, working, fresh, False, False)
        self._begin(source, self._packs_of_shard, working)
        messages.sends, messages.receives = self._started_messages()
        messages.requests = self._requests
        copied = self._copies_first(fresh)
        if copied:  # under the agreement
            self._copy_interior(x, out, source, working, False)
        return PadStart(out, source, working, fresh, True, copied)

    def finish_pad(self, x, pad):
        """Finish the pad of ``x`` that :meth:`start_pad` prepared (``pad``); return the padded result."""
        if not pad.started:
            self._begin(pad.source, self._packs_of_shard, pad.working)
        self._complete(x, pad.out, pad.source, pad.working, pad.fresh, pad.copied)
        return pad.out

    def pad_prepared(self, agreement, messages, host, out):
        """Pad host shard ``host`` with its halos started along ``agreement``; return the result, or None to build anew.

        For a plan whose ``pads_in_one_copy``: ``host`` is a NumPy view of the shard, ``out`` the result's array
        (None: a new one), ``agreement`` prepared (``start=False``) and started here, the halos listed in
        ``messages``. None means the agreement found that some rank missed: every rank's halos are settled.
        What :meth:`start_pad` and :meth:`finish_pad` do, with what does not change from call to call prepared
        once: the same agreement, the same messages, in the same order.
        """
        agreement.start()
        if out is None:
            working = np.empty(self.padded_shape, self._numpy_dtype)
            out = self._wrap(working)
        else:
            working = devices.host_view(out)
        ahead = agreement.ahead
        if ahead:
            self._begin(host, self._packs_of_shard, working)
            if messages.requests is not self._requests:  # first use, or the receives were rebound
                messages.sends, messages.receives = self._started_messages()
                messages.requests = self._requests
        completed = agreement.wait()
        if not agreement.went_through():
            agreement.conclude(completed)  # raises, or settles the halos and says build anew
            return None
        if not ahead:
            self._begin(host, self._packs_of_shard, working)
        if not completed and self._requests:
            self._wait_transfers()
        working[self._interior] = host
        self._fill_ghosts(working)
        return out

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
        shard_rows = self.layout.shard_rows
        for source, ghost, flip in self._copies:
            devices.add_into(out[shard_rows(source)], devices.flip(grad[ghost], flip))
        if not self._requests:
            return out
        # Each forward message in reverse, same tag: the ghost rows' gradients (packed into
        # the forward receive buffers) go back to their owners, arriving in the send buffers.
        working = self.transport.view(grad)
        for bundle, views in zip(self._receives, self._recv_views):
            for m, view in zip(bundle.blocks, views):
                self.transport.pack(working[m.rows], view)
        self.transport.synchronize(grad)
        requests = [self._comm.Irecv(message(buffer), source=m.peer, tag=m.tag)
                    for m, buffer in zip(self._sends, self._send_buffers)]
        requests += [self._comm.Isend(message(buffer), dest=m.peer, tag=m.tag)
                     for m, buffer in zip(self._receives, self._recv_buffers)]
        if comm_stats.recorder is not None:
            comm_stats.sent("halo", sum(buffer.nbytes for buffer in self._recv_buffers))
        wait_all(requests, comm=self._comm, call="HaloPlan.adjoint",
                 awaiting=lambda: _awaiting(self._sends, self._receives))
        for bundle, views in zip(self._sends, self._send_views):
            for m, view in zip(bundle.blocks, views):
                self.transport.accumulate(_mirrored(view, m.flip), out[shard_rows(m.rows)])
        self.transport.synchronize(out)  # the next exchange reuses the buffers
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
        plan_cache.unregister(self)
        if is_active():
            for request in self._requests:
                if request != mpi().REQUEST_NULL:
                    request.Free()
            for datatype in self._recv_types:
                datatype.Free()
        self._requests, self._recv_types, self._messages = [], [], None
        self._send_buffers = self._recv_buffers = self._send_views = self._recv_views = self._like = None
        self._packs_of_shard = self._packs_of_padded = self._unpacks = []

    def __del__(self):
        # Local handles only, so safe at any time; a plan dropped mid-exchange keeps its
        # requests (freeing an active request would let MPI write into freed memory). At
        # interpreter exit the module globals _release needs are going: MPI_Finalize frees them.
        if not self._exiting and not getattr(self, "_freed", True) and getattr(self, "_in_flight", None) is None:
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
        state = "freed" if self._freed else f"neighbors={self.neighbors}, transport={self.transport.name}"
        boundary = f"boundary={self.boundary!r}, " if self.boundary else ""
        return (f"HaloPlan(shape={self.shape}, dtype={self.dtype}, halo_width={self.halo_width}, "
                f"dim={self.dim}, periodic={self.periodic}, {boundary}{state})")


class PadStart(NamedTuple):
    """A pad :meth:`HaloPlan.start_pad` prepared, for :meth:`HaloPlan.finish_pad`."""

    out: object      # the padded result
    source: object   # the Transport.view of x
    working: object  # the Transport.view of out
    fresh: bool      # whether out was allocated for this call
    started: bool    # whether the halos are in flight (usually complete)
    copied: bool     # whether x is in out's interior already


@dataclasses.dataclass(frozen=True)
class _Bundle:
    """The blocks (layout messages) one rank exchanges with ``peer`` in one direction: one MPI message."""

    peer: int
    tag: int
    blocks: tuple


def _bundles(messages):
    """Group a layout's messages by peer, each group in tag order (the order both ends see)."""
    peers = {}
    for m in messages:
        peers.setdefault(m.peer, []).append(m)
    return [_Bundle(peer, min(m.tag for m in group), tuple(sorted(group, key=lambda m: m.tag)))
            for peer, group in peers.items()]


def _elements(shape, bundle):
    """The number of elements of ``bundle``'s blocks of an array of ``shape``."""
    return sum(math.prod(block_shape(shape, m.rows)) for m in bundle.blocks)


def _views(buffer, shape, bundle):
    """Views of flat ``buffer``, one per block of ``bundle``, each of its block's shape."""
    views, start = [], 0
    for m in bundle.blocks:
        block = block_shape(shape, m.rows)
        n = math.prod(block)
        views.append(buffer[start:start + n].reshape(block))
        start += n
    return views


def _mirrored(buffer, dims):
    """``buffer`` mirrored along ``dims`` as a contiguous array (``buffer`` itself if none)."""
    if not dims:
        return buffer
    flipped = devices.flip(buffer, dims)
    return flipped if devices.array_kind(flipped) == "torch" else flipped.copy()  # NumPy, CuPy: a view so far


def _awaiting(receives, sends):
    """What each request of a transfer (receives first, then sends) waits for, in words, for a timeout's message."""
    return ([f"the message from domain rank {m.peer} (tag {m.tag})" for m in receives]
            + [f"domain rank {m.peer} to take this rank's message (tag {m.tag})" for m in sends])

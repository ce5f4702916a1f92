"""Deal the rows of a sharded dim out anew among its ranks: one all-to-all, per a :class:`RowMove`.

:func:`redistribute` moves the rows of ``x`` along one dim the manager shards
(latitude or longitude; with tiles, within this rank's column or band of
tiles) from the move's source layout to its target layout. Each rank packs the
rows for each peer (in the target's order) into one contiguous buffer, one
``MPI_Alltoallv`` over the manager's private communicator moves them (counted
in rows of one contiguous datatype, so no count overflows), and the received
rows are put in the target's local order. Device arrays go through
:func:`mpidomain.transport.transport_for` like every other collective.

The move (pure, immutable, from :mod:`mpidomain.redistribution_layout`) is the
plan: building it communicates nothing, and the index arrays made from it are
cached per (move, rank, device), so a cache hit or miss on one rank cannot put
the ranks out of step. Every call starts with one agreement step: a different
move, dim, dtype, or a local mistake on any rank raises on every rank before
any byte moves. The adjoint of a move is its inverse (a permutation of rows):
:class:`mpidomain.nn.Redistribute` is the differentiable form.
"""

import functools
import math

import numpy as np

from . import comm_stats, devices, transport
from ._agreement import agree
from ._errors import digest
from ._mpi import mpi
from ._validate import normalize_dim, require_manager
from .manager import library_comm
from .redistribution_layout import RowMove

__all__ = ["redistribute"]


def _sharded(manager, ndim):
    """The manager's sharded dims of an ``ndim``-d array (normalised), with their group names."""
    # Tiles: latitude moves within a column of tiles, longitude within a band.
    names = ("column", "band") if manager.tiled else ("domain",)
    return {d % ndim: name for d, name in zip(manager.shard_dims, names) if -ndim <= d < ndim}


def _describe(x, move, dim, manager):
    """What this rank passed (alike on every rank) and the group name; TypeError/ValueError for a local mistake."""
    if not isinstance(move, RowMove):
        raise TypeError(f"move must be a mpidomain.redistribution_layout.RowMove, got {type(move).__name__}; "
                        "make one with window_move or RowMove(source, target)")
    spec = devices.array_spec(x)
    if isinstance(dim, (tuple, list)):
        raise ValueError(f"redistribute moves rows along one dim at a time, got dim={dim!r}; with tiles call it "
                         "once per dim, e.g. dim=-2 then dim=-1")
    if getattr(x, "requires_grad", False) is True:
        raise TypeError("redistribute is not differentiable; for a tensor that requires grad use "
                        "mpidomain.nn.Redistribute (its backward moves the gradient back), or pass x.detach()")
    shape = tuple(int(n) for n in x.shape)
    dim = normalize_dim(dim, shape)
    sharded = _sharded(manager, len(shape))
    if dim not in sharded:
        raise ValueError(f"redistribute: dim={dim} of a {len(shape)}-d array is not a dim the manager shards "
                         f"(shard_dim={manager.shard_dim}); pass one of {sorted(sharded)}")
    group = sharded[dim]
    comm = library_comm(manager, group)
    if move.size != comm.Get_size():
        raise ValueError(f"redistribute: the move deals rows over {move.size} ranks, but {comm.Get_size()} ranks "
                         f"share dim {dim}; make the move for that many ranks")
    rank = comm.Get_rank()
    if shape[dim] != move.source.extents[rank]:
        raise ValueError(f"redistribute: x has {shape[dim]} rows along dim {dim}, but the move's source layout gives "
                         f"this rank (rank {rank} of the {group} group) {move.source.extents[rank]}; pass the "
                         "shard the move was made for")
    others = tuple(None if i in sharded else n for i, n in enumerate(shape))
    return (_code(move), dim, spec, others), group


_code = functools.lru_cache(maxsize=256)(digest)  # a move's digest, once per move (hashing it is cheap)


def redistribute(x, move, dim=None, *, manager=None):
    """Return this rank's rows of ``x`` in ``move``'s target layout along ``dim``.

    Collective over the domain group: call on every rank with the same ``move``
    (a :class:`~mpidomain.redistribution_layout.RowMove` over the ranks that
    share ``dim``: all of them with slabs; with tiles, the ranks of this rank's
    column of tiles for latitude, of its band for longitude), ``dim`` (default
    the manager's ``shard_dim``; with tiles pass one of its two dims) and dtype.
    Each rank passes its rows in the move's source layout and gets a new array
    of ``x``'s kind, dtype and device holding its rows of the target layout, in
    that layout's local order (extents elsewhere unchanged). Not differentiable:
    :class:`mpidomain.nn.Redistribute` is. A mismatch on any rank raises on every
    rank, before any rows move.

    For example, on two slabs of an 8-row field (rows 0-3 and 4-7),
    ``redistribute(x, window_move("long", (4, 4), 2), -2)`` gives rank 0 rows
    ``(0, 1, 4, 5)`` and rank 1 rows ``(2, 3, 6, 7)``: the long-range groups
    ``{0, 4}, {1, 5}`` and ``{2, 6}, {3, 7}``, each rank's ``l1``-major.
    """
    manager = require_manager(manager, "redistribute")
    domain = library_comm(manager)
    description, group, error = None, None, None
    try:
        description, group = _describe(x, move, manager.shard_dim if dim is None else dim, manager)
    except (TypeError, ValueError) as exc:
        error = exc
    agree(domain, "redistribute", description, error=error)
    return _move(library_comm(manager, group), x, move, description[1])


@functools.lru_cache(maxsize=128)
def _indices(move, rank):
    """(rows to send in peer order, rows sent per peer, how to reorder the received rows, rows received per peer)."""
    sends, receives = move.sends(rank), move.receives(rank)
    landing = [local for rows in receives for local in rows]
    reorder = np.empty(len(landing), dtype=np.int64)
    reorder[landing] = np.arange(len(landing))  # received row k lands at landing[k]
    send_index = np.array([local for rows in sends for local in rows], dtype=np.int64)
    return send_index, tuple(len(r) for r in sends), reorder, tuple(len(r) for r in receives)


@functools.lru_cache(maxsize=128)
def _device_indices(move, rank, device):
    """:func:`_indices` as Torch tensors on ``device``."""
    import torch

    send_index, send_counts, reorder, recv_counts = _indices(move, rank)
    return torch.as_tensor(send_index, device=device), send_counts, torch.as_tensor(reorder, device=device), recv_counts


def _take(x, index, dim):
    """A new C-contiguous array of ``x``'s rows ``index`` along ``dim``, put first (``index`` from :func:`_indices`)."""
    kind = devices.array_kind(x)
    if kind == "torch":
        return x.movedim(dim, 0).index_select(0, index).contiguous()
    if kind == "cupy":
        import cupy

        return cupy.ascontiguousarray(cupy.moveaxis(x, dim, 0)[cupy.asarray(index)])
    return np.ascontiguousarray(np.moveaxis(x, dim, 0)[index])


def _put_back(rows, dim):
    """``rows`` (rows first) with the rows moved back to ``dim``, C-contiguous."""
    kind = devices.array_kind(rows)
    if kind == "torch":
        return rows.movedim(0, dim).contiguous()
    if kind == "cupy":
        import cupy

        return cupy.ascontiguousarray(cupy.moveaxis(rows, 0, dim))
    return np.ascontiguousarray(np.moveaxis(rows, 0, dim))


def _move(comm, x, move, dim):
    """The all-to-all of :func:`redistribute` over ``comm`` (its checks done)."""
    rank = comm.Get_rank()
    kind = devices.array_kind(x)
    if kind == "torch":
        x = x.detach()
        send_index, send_counts, reorder, recv_counts = _device_indices(move, rank, x.device)
    else:
        send_index, send_counts, reorder, recv_counts = _indices(move, rank)
    rest = tuple(int(n) for n in x.shape[:dim] + x.shape[dim + 1:])
    send = _take(x, send_index, dim)
    received = devices.empty((sum(recv_counts),) + rest, like=x)
    row_bytes = math.prod(rest) * devices.numpy_dtype(x).itemsize
    if row_bytes and len(move.source.order):  # alike on every rank: the rows' extents outside dim were agreed
        MPI = mpi()
        row = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        try:
            way = transport.transport_for(x)
            send_displs = np.cumsum((0,) + send_counts[:-1]).tolist()
            recv_displs = np.cumsum((0,) + recv_counts[:-1]).tolist()
            source = way.readable(send) if send.shape[0] else np.empty(0, np.uint8)
            with way.writable(received) as memory:
                target = memory if received.shape[0] else np.empty(0, np.uint8)
                if comm_stats.recorder is not None:
                    comm_stats.sent("alltoall", (send.shape[0] - send_counts[comm.Get_rank()]) * row_bytes)
                began = comm_stats.clock() if comm_stats.timer is not None else None
                comm.Alltoallv([source, (list(send_counts), send_displs), row],
                               [target, (list(recv_counts), recv_displs), row])
                if began is not None:
                    comm_stats.waited(comm_stats.clock() - began)
        finally:
            row.Free()
    return _put_back(_take(received, reorder, 0), dim)

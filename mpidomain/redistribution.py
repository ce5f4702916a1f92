"""Deal the rows of a sharded dim out anew among its ranks: one all-to-all, per a :class:`RowMove`.

:func:`redistribute` moves the rows of ``x`` along one dim the manager shards
(latitude or longitude; with tiles, within this rank's column or band of
tiles) from the move's source layout to its target layout; with tiles, a pair
of moves re-deals both dims at once, in one all-to-all over the domain group
(each pixel goes straight to the rank that holds its row and its column in the
targets, so a pixel that changes both travels once). Each rank packs the rows
(or pixels) for each peer, in the target's order, into one contiguous buffer,
one ``MPI_Alltoallv`` over the manager's private communicator moves them
(counted in rows of one contiguous datatype, so no count overflows), and the
received rows are put in the target's local order. Device arrays go through
:func:`mpidomain.transport.transport_for` like every other collective.

The move (pure, immutable, from :mod:`mpidomain.layout.moves`) is the
plan: building it communicates nothing, and the index arrays made from it are
cached per (moves, this rank's coordinates, device), so a cache hit or miss on
one rank cannot put the ranks out of step. Every call starts with one agreement
step: a different move, dim, dtype, or a local mistake on any rank raises on
every rank before any byte moves (with tiles, a move along one dim then checks,
in one Allgather, the other extents of the ranks that share it). The adjoint of
a move is its inverse (a permutation of rows): :class:`mpidomain.nn.Redistribute`
is the differentiable form.
"""

import functools
import itertools
import math

import numpy as np

from . import comm_stats, devices, transport
from ._agreement import agree
from ._errors import digest
from ._mpi import mpi
from ._waits import allgather_ints
from ._current import require_manager
from ._validate import normalize_dim
from .manager import library_comm, sharded_dims
from .layout.moves import RowMove

__all__ = ["redistribute"]


def _sharded(manager, ndim):
    """The manager's sharded dims of an ``ndim``-d array (normalised), with their group names."""
    return {s.dim: s.group for s in sharded_dims(manager, ndim)}


def _pair(manager, shape, move, dim):
    """Both dims of tiles at once: ((lat dim, lon dim), (lat move, lon move)); ValueError naming the fix."""
    pair = isinstance(move, (tuple, list))
    if not manager.tiled:
        raise ValueError(f"redistribute: a pair of dims or moves needs tiles, but the manager's domain_shape is "
                         f"{manager.domain_shape} (slabs); call it once per dim, with one move")
    if not pair or len(move) != 2 or len(dim) != 2:
        given = (f"{len(move)} move{'s' * (len(move) != 1)}" if pair else "one move")
        dims_given = dim[0] if len(dim) == 1 else tuple(dim)
        raise ValueError(f"redistribute: with tiles, re-dealing both dims at once takes dim=(lat, lon) and a pair "
                         f"of moves, got dim={dims_given!r} with {given}; pass move=(lat_move, lon_move) and "
                         f"dim={tuple(manager.shard_dim)!r}, or one move and one dim")
    dims = tuple(normalize_dim(d, shape) for d in dim)
    sharded = tuple(d % len(shape) for d in manager.shard_dims)
    if dims != sharded or dims[1] != dims[0] + 1:
        raise ValueError(f"redistribute: dim={tuple(dim)!r} must be the manager's two sharded dims in its order "
                         f"(shard_dim={manager.shard_dim}), adjacent in x; otherwise call it once per dim")
    return dims, tuple(move)


def _describe(x, move, dim, manager):
    """(what this rank passed, alike on every rank; (group name, moves, coordinates along them)).

    TypeError/ValueError for a local mistake.
    """
    moves = tuple(move) if isinstance(move, (tuple, list)) else (move,)
    wrong = [(i, m) for i, m in enumerate(moves) if not isinstance(m, RowMove)]
    if not moves or wrong:
        if wrong and isinstance(move, (tuple, list)):
            what = f"move[{wrong[0][0]}] has type {type(wrong[0][1]).__name__}"
        else:
            what = f"got {type(move).__name__}{' (empty)' * (not moves)}"
        raise TypeError(f"move must be a mpidomain.layout.moves.RowMove (or, with tiles, a pair of them), {what}; "
                        "make one with window_move or RowMove(source, target)")
    spec = devices.array_spec(x)
    if getattr(x, "requires_grad", False) is True:
        raise TypeError("redistribute is not differentiable; for a tensor that requires grad use "
                        "mpidomain.nn.Redistribute (its backward moves the gradient back), or pass x.detach()")
    shape = tuple(int(n) for n in x.shape)
    sharded = _sharded(manager, len(shape))
    if isinstance(dim, (tuple, list)) or isinstance(move, (tuple, list)):
        dims, moves = _pair(manager, shape, move, dim if isinstance(dim, (tuple, list)) else (dim,))
        group, coords, sizes = "domain", tuple(manager.domain_coords), tuple(manager.domain_shape)
    else:
        dims = (normalize_dim(dim, shape),)
        if dims[0] not in sharded:
            raise ValueError(f"redistribute: dim={dims[0]} of a {len(shape)}-d array is not a dim the manager shards "
                             f"(shard_dim={manager.shard_dim}); pass one of {sorted(sharded)}")
        group = sharded[dims[0]]
        comm = library_comm(manager, group)
        coords, sizes = (comm.Get_rank(),), (comm.Get_size(),)
    for d, m, coord, size in zip(dims, moves, coords, sizes):
        if m.size != size:
            raise ValueError(f"redistribute: the move deals rows over {m.size} ranks, but {size} ranks share dim "
                             f"{d}; make the move for that many ranks")
        if shape[d] != m.source.extents[coord]:
            where = (f"rank {coord} of the {group} group" if len(dims) == 1
                     else f"tile coordinate {coord} along that dim")
            raise ValueError(f"redistribute: x has {shape[d]} rows along dim {d}, but the move's source layout gives "
                             f"this rank ({where}) {m.source.extents[coord]}; pass the shard the move was made for")
    others = tuple(None if i in sharded else n for i, n in enumerate(shape))
    return (tuple(_code(m) for m in moves), dims, spec, others), (group, moves, coords)


_code = functools.lru_cache(maxsize=256)(digest)  # a move's digest, once per move (hashing it is cheap)

_FIELDS = ("move (or moves)", "dim", "array kind, dtype and device", "extents of the dims not sharded")


def _mismatch(descriptions):
    """The ValueError for ranks that passed different moves, dims, dtypes or extents: it names what differs."""
    differing = [name for i, name in enumerate(_FIELDS) if len({repr(d[i]) for d in descriptions}) > 1]
    listing = ", ".join(f"rank {r}: dim {dims}, {spec.kind} {spec.dtype} on {spec.device}, extents {others}"
                        for r, (_, dims, spec, others) in enumerate(descriptions))
    return ValueError(f"redistribute needs the same move, dim, dtype and unsharded extents on every rank; the ranks "
                      f"passed a different {' and '.join(differing)} ({listing}); build the move from the same "
                      "layouts on every rank and pass the same dim")


def redistribute(x, move, dim=None, *, manager=None):
    """Return this rank's rows of ``x`` in ``move``'s target layout along ``dim``.

    Collective over the domain group: call on every rank with the same ``move``
    (a :class:`~mpidomain.layout.moves.RowMove` over the ranks that
    share ``dim``: all of them with slabs; with tiles, the ranks of this rank's
    column of tiles for latitude, of its band for longitude), ``dim`` (default
    the manager's ``shard_dim``; with tiles one of its two dims, or both) and dtype.
    Each rank passes its rows in the move's source layout and gets a new array
    of ``x``'s kind, dtype and device holding its rows of the target layout, in
    that layout's local order (extents elsewhere unchanged).

    With tiles, ``move=(lat_move, lon_move)`` and ``dim`` the manager's two
    sharded dims (e.g. ``(-2, -1)``) re-deal both at once: one all-to-all over
    the domain group, each rank getting the target rows of its tile column
    crossed with the target columns of its tile row. It gives the same array as
    the two moves one after the other, and sends fewer bytes (a pixel that
    changes both its row's and its column's rank travels once, not twice).

    Not differentiable: :class:`mpidomain.nn.Redistribute` is. A mismatch on
    any rank raises on every rank, before any rows move.

    For example, on two slabs of an 8-row field (rows 0-3 and 4-7),
    ``redistribute(x, window_move("long", (4, 4), 2), -2)`` gives rank 0 rows
    ``(0, 1, 4, 5)`` and rank 1 rows ``(2, 3, 6, 7)``: the long-range groups
    ``{0, 4}, {1, 5}`` and ``{2, 6}, {3, 7}``, each rank's ``l1``-major.
    """
    manager = require_manager(manager, "redistribute")
    domain = library_comm(manager)
    description, route, error = None, None, None
    try:
        description, route = _describe(x, move, manager.shard_dim if dim is None else dim, manager)
    except (TypeError, ValueError) as exc:
        error = exc
    agree(domain, "redistribute", description, error=error, mismatch=_mismatch)
    group, moves, coords = route
    dims = description[1]
    if manager.tiled and len(dims) == 1:
        _check_group_extents(domain, manager, x, dims[0], group)
    return _move(library_comm(manager, group), x, moves, coords, dims)


def _check_group_extents(domain, manager, x, dim, group):
    """With tiles, a move along one dim: raise ValueError on every rank unless the ranks that share it (a column or
    band of tiles) hold the same extents apart from ``dim``; one Allgather over the domain group.

    The other tile dim's extent differs between columns (bands), so the agreement leaves it out; within one, the
    ranks' rows must be alike, or their Alltoallv could not match.
    """
    # The group: the ranks of one coordinate along the other tile dim (an x without that dim: one coordinate, 0).
    other = next((s.coord for s in sharded_dims(manager, x.ndim) if s.dim != dim), 0)
    rest = tuple(int(n) for i, n in enumerate(x.shape) if i != dim)
    everyone = allgather_ints(domain, (other,) + rest, "redistribute")
    extents = {}
    for rank, (coord, *theirs) in enumerate(everyone):
        extents.setdefault(coord, {}).setdefault(tuple(theirs), []).append(rank)
    differing = {coord: found for coord, found in extents.items() if len(found) > 1}
    if differing:
        listing = "; ".join(", ".join(f"domain ranks {ranks}: {shape}" for shape, ranks in found.items())
                            for found in differing.values())
        raise ValueError(f"redistribute: the ranks of one {group} group must hold the same extents of x apart from "
                         f"dim {dim}, got {listing}; pass each rank its own tile of the same field")


def _flat(rows, extents):
    """The flat (row-major) local indices of the pixels ``rows[0] x rows[1] x ...`` of a block of ``extents``."""
    if len(rows) == 1:
        return list(rows[0])
    grid = np.meshgrid(*(np.asarray(r, dtype=np.int64) for r in rows), indexing="ij")
    return np.ravel_multi_index(grid, extents).ravel().tolist() if grid[0].size else []


@functools.lru_cache(maxsize=128)
def _indices(moves, coords):
    """(pixels to send in peer order, pixels sent per peer, how to reorder the received ones, received per peer).

    A pixel is one row (one move) or one (row, column) pair (a pair of moves);
    the peers run row-major over the moves' ranks (the domain ranks of tiles).
    """
    sends = [m.sends(c) for m, c in zip(moves, coords)]
    receives = [m.receives(c) for m, c in zip(moves, coords)]
    source = tuple(m.source.extents[c] for m, c in zip(moves, coords))
    target = tuple(m.target.extents[c] for m, c in zip(moves, coords))
    send_index, send_counts, landing, recv_counts = [], [], [], []
    for peer in itertools.product(*(range(m.size) for m in moves)):
        block = _flat([s[p] for s, p in zip(sends, peer)], source)
        send_index += block
        send_counts.append(len(block))
        block = _flat([r[p] for r, p in zip(receives, peer)], target)
        landing += block
        recv_counts.append(len(block))
    reorder = np.empty(len(landing), dtype=np.int64)
    reorder[landing] = np.arange(len(landing))  # received pixel k lands at landing[k]
    return np.array(send_index, dtype=np.int64), tuple(send_counts), reorder, tuple(recv_counts)


@functools.lru_cache(maxsize=128)
def _device_indices(moves, coords, device):
    """:func:`_indices` as Torch tensors on ``device``."""
    import torch

    send_index, send_counts, reorder, recv_counts = _indices(moves, coords)
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


def _put_back(rows, dim, extents):
    """``rows`` (pixels first) with the pixels back at ``dim`` as ``extents`` (one or two dims), C-contiguous."""
    kind = devices.array_kind(rows)
    shape = tuple(rows.shape[1:dim + 1]) + tuple(extents) + tuple(rows.shape[dim + 1:])
    if kind == "torch":
        return rows.movedim(0, dim).reshape(shape).contiguous()
    if kind == "cupy":
        import cupy

        return cupy.ascontiguousarray(cupy.moveaxis(rows, 0, dim)).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(rows, 0, dim)).reshape(shape)


def _move(comm, x, moves, coords, dims):
    """The all-to-all of :func:`redistribute` over ``comm`` (its checks done): ``moves`` along ``dims`` (adjacent)."""
    kind = devices.array_kind(x)
    dim = dims[0]
    if kind == "torch":
        x = x.detach()
        send_index, send_counts, reorder, recv_counts = _device_indices(moves, coords, x.device)
    else:
        send_index, send_counts, reorder, recv_counts = _indices(moves, coords)
    if len(dims) > 1:  # the two dims as one of pixels (a view where x allows it)
        pixels = math.prod(int(n) for n in x.shape[dim:dims[-1] + 1])
        x = x.reshape(tuple(x.shape[:dim]) + (pixels,) + tuple(x.shape[dims[-1] + 1:]))
    rest = tuple(int(n) for n in x.shape[:dim] + x.shape[dim + 1:])
    send = _take(x, send_index, dim)
    received = devices.empty((sum(recv_counts),) + rest, like=x)
    row_bytes = math.prod(rest) * devices.numpy_dtype(x).itemsize
    if row_bytes and all(len(m.source.order) for m in moves):  # alike on every rank: agreed extents
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
    return _put_back(_take(received, reorder, 0), dim, tuple(m.target.extents[c] for m, c in zip(moves, coords)))

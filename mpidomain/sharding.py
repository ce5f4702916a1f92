"""Cut arrays into latitude shards (or latitude x longitude tiles), and bring them together or apart over MPI.

``shard_tensor`` and ``shard_batch`` are local (no communication): every rank
slices the same full array. ``gather_tensor`` and ``scatter_tensor`` move data
over the manager's domain communicator, checked once across the whole domain
group for slabs and tiles alike (a slab is a tile of a grid with one sharded
dim); tiles then move along longitude and latitude in turn. Splits are
balanced: ``extent`` rows over ``D`` ranks give the first ``extent % D``
ranks one row more.

On the wire every shard travels as its own contiguous bytes. Host arrays are
placed straight into the full array by MPI derived datatypes (one strided
block of rows per rank, no packing copies); device arrays go to a CUDA-aware
MPI as contiguous blocks and are joined on the device, or are staged through
pinned host memory otherwise.
"""

import itertools
import math

import numpy as np

from . import devices, transport
from ._agreement import agree
from ._mpi import mpi
from ._waits import wait_all
from ._current import closed_error, current_manager, require_manager
from ._validate import normalize_dim, require_int
from .manager import library_comm
from .layout.tiles import balanced_split  # public here too: mpidomain.sharding.balanced_split

__all__ = ["balanced_split", "shard_tensor", "shard_batch", "gather_tensor", "scatter_tensor"]

# Tag of scatter_tensor's point-to-point messages on the (private) domain communicator.
_SCATTER_TAG = 23719


def _active_manager(manager, what=None):
    """Return the manager to split over, or None when there is nothing to split (no manager alone, D=1).

    Local entry points (``what`` None) keep CREDIT's semantics: no manager
    means no split. Collective ones name themselves in ``what``: with no
    manager in a job of several processes they raise, as halo exchange and
    all-reduce do, instead of returning each rank's own array.
    """
    if what is not None:
        manager = require_manager(manager, what, alone_ok=True)
    elif manager is None:
        manager = current_manager()
    if manager is None or manager.domain_parallel_size == 1:
        return None
    if manager.closed:
        raise closed_error(manager)
    return manager


def _rows(dim, start, stop):
    """Index selecting rows ``start:stop`` along ``dim`` (works for NumPy, CuPy and Torch)."""
    return (slice(None),) * dim + (slice(start, stop),)


def _copy_rows(x, dim, start, count):
    """Return a C-contiguous copy of rows ``start:start+count`` of ``x`` along ``dim``."""
    if devices.array_kind(x) == "torch":
        import torch

        return x.narrow(dim, start, count).clone(memory_format=torch.contiguous_format)
    return x[_rows(dim, start, start + count)].copy(order="C")


def _dims_for(manager, dim, what):
    """``dim`` for ``manager``'s decomposition: an int for slabs, a pair for tiles (default: the manager's).

    Raise ValueError naming the fix when ``dim`` does not match it.
    """
    if dim is None:
        return manager.shard_dim
    tiles = manager.tiled
    if isinstance(dim, (tuple, list)) != tiles or (tiles and len(dim) != 2):
        layout = f"{manager.domain_shape[0]} x {manager.domain_shape[1]} tiles" if tiles else "latitude slabs"
        expected = "a pair of dims (latitude, longitude), e.g. (-2, -1)" if tiles else "one dim, e.g. -2"
        raise ValueError(f"{what}: the manager's domain is {layout}, so dim must be {expected}, got dim={dim!r}; "
                         "pass dim=None for the manager's shard_dim")
    return tuple(dim) if tiles else dim


def _agreed_dims(comm, manager, dim, call):
    """:func:`_dims_for` in collective ``call``: a wrong ``dim`` on one rank raises on every rank.

    The erring rank's agreement step meets the others' first one (each call starts with one).
    """
    try:
        return _dims_for(manager, dim, call)
    except ValueError as error:
        agree(comm, call, None, error=error)
        raise


def _tile_slices(manager, shape, dims, allow_uneven):
    """This rank's (dim, start, count) along each sharded dim of an array of ``shape``."""
    dims = tuple(normalize_dim(d, shape) for d in (dims if isinstance(dims, tuple) else (dims,)))
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim={dims} names a dim twice; pass latitude then longitude, e.g. (-2, -1)")
    cuts = []  # slabs are a grid of one dim: domain_shape (D,), domain_coords (domain_rank,)
    for dim, parts, c in zip(dims, manager.domain_shape, manager.domain_coords):
        size = shape[dim]
        if size % parts and not allow_uneven:
            raise ValueError(
                f"Cannot shard dim {dim} of size {size} evenly across {parts} domain-parallel ranks; "
                f"pass allow_uneven=True for a balanced split (the first {size % parts} ranks get one row more) "
                f"or use a domain_parallel_size that divides {size}"
            )
        counts, offsets = balanced_split(size, parts)
        cuts.append((dim, offsets[c], counts[c]))
    return cuts


def shard_tensor(x, dim=None, manager=None, *, allow_uneven=False):
    """Return this domain rank's shard of ``x`` along ``dim``, as a contiguous copy.

    Local: no communication; every domain rank passes the same full array and
    keeps its own rows. ``dim`` defaults to the manager's ``shard_dim``; with
    tiles it is a pair, ``(-2, -1)``, and the rank at ``(i_lat, i_lon)`` keeps
    tile ``(i_lat, i_lon)`` of each dim's :func:`balanced_split`. Returns ``x``
    itself when there is no manager (``manager`` is None and none is
    initialised) or D=1 (CREDIT's semantics). An extent that the ranks along
    it do not divide raises ValueError ("Cannot shard ...") unless
    ``allow_uneven=True``, which splits as :func:`balanced_split`. Torch
    tensors keep their autograd history.
    """
    manager = _active_manager(manager)
    if manager is None:
        return x
    devices.array_kind(x)
    cuts = _tile_slices(manager, x.shape, _dims_for(manager, dim, "shard_tensor"), allow_uneven)
    for dim, start, count in cuts[:-1]:
        x = x.narrow(dim, start, count) if devices.array_kind(x) == "torch" else x[_rows(dim, start, start + count)]
    dim, start, count = cuts[-1]
    return _copy_rows(x, dim, start, count)


def _is_array(value):
    try:
        devices.array_kind(value)
    except TypeError:
        return False
    return True


def shard_batch(batch, spatial_dims_5d=None, spatial_dims_4d=None, manager=None, *, allow_uneven=False):
    """Return a new dict with the 5-D and 4-D arrays of ``batch`` sharded; all else untouched.

    Local, like :func:`shard_tensor`: 5-D (B, C, T, H, W) arrays are sharded
    along ``spatial_dims_5d``, 4-D (B, C, H, W) along ``spatial_dims_4d``
    (NumPy, CuPy or Torch), by default the manager's ``shard_dim``; scalars, indices, strings and 1-D to 3-D arrays
    pass through as they are. Returns ``batch`` itself when there is no
    manager or D=1 (CREDIT's semantics).
    """
    manager = _active_manager(manager)
    if manager is None:
        return batch
    dims = {5: spatial_dims_5d, 4: spatial_dims_4d}
    sharded = {}
    for key, value in batch.items():
        if _is_array(value) and value.ndim in dims:
            sharded[key] = shard_tensor(value, dims[value.ndim], manager, allow_uneven=allow_uneven)
        else:
            sharded[key] = value
    return sharded


def _row_type(row_bytes, rows):
    """Return a committed datatype of ``rows`` contiguous rows of ``row_bytes`` bytes."""
    row = mpi().BYTE.Create_contiguous(row_bytes)
    rows_type = row.Create_contiguous(rows).Commit()
    row.Free()
    return rows_type


def _placed_types(outer, row_bytes, counts, offsets, total):
    """Return per-rank committed datatypes placing ``counts[r]`` rows at row ``offsets[r]`` of a full array.

    The full array is ``outer`` blocks of ``total`` rows of ``row_bytes``
    bytes; a shard travels as its contiguous bytes and lands as ``outer``
    strided blocks of rows, with no packing. Ranks with no rows get None.
    """
    MPI = mpi()
    row = MPI.BYTE.Create_contiguous(row_bytes)
    types = []
    for count, offset in zip(counts, offsets):
        if count == 0:
            types.append(None)
            continue
        block = row.Create_vector(outer, count, total)
        types.append(MPI.Datatype.Create_struct([1], [offset * row_bytes], [block]).Commit())
        block.Free()
    row.Free()
    return types


def _free(types):
    for datatype in types:
        if datatype is not None:
            datatype.Free()


def _alltoallw(comm, sendbuf, send_types, recvbuf, recv_types):
    """One MPI_Alltoallw (waited for at most ``MPIDOMAIN_TIMEOUT``); ``None`` in a type list means nothing to or from that rank."""
    MPI = mpi()
    counts = [[int(t is not None) for t in types] for types in (send_types, recv_types)]
    types = [[t if t is not None else MPI.BYTE for t in types] for types in (send_types, recv_types)]
    zeros = [0] * comm.Get_size()
    request = comm.Ialltoallw([sendbuf, counts[0], zeros, types[0]], [recvbuf, counts[1], zeros, types[1]])
    wait_all([request], comm=comm, call="gather_tensor", awaiting=["the shards of every other rank of the group"])


def _concatenate(blocks, dim, out=None):
    kind = devices.array_kind(blocks[0])
    if kind == "torch":
        import torch

        return torch.cat(blocks, dim, out=out)
    if kind == "cupy":
        import cupy

        return cupy.concatenate(blocks, axis=dim, out=out)
    return np.concatenate(blocks, axis=dim, out=out)


def _exchange_reports(comm, call, describe):
    """Return every rank's ``describe()``; if it raised on any rank, or a rank is in another call, raise on every rank.

    Collective over ``comm``: one agreement Allreduce, then one allgather.
    """
    error = report = None
    try:
        report = describe()
    except (TypeError, ValueError) as exc:
        error = exc
    agree(comm, call, None, error=error)
    return comm.allgather(report)


def _out_report(out):
    """Describe a caller's ``out`` array for the agreement check: None, or (spec, shape, contiguous)."""
    if out is None:
        return None
    contiguous = out.is_contiguous() if devices.array_kind(out) == "torch" else out.flags.c_contiguous
    return devices.array_spec(out), tuple(out.shape), bool(contiguous)


def _out_mismatch(function, outs, expected):
    """Return a ValueError if some rank's ``out`` is not like its result ``expected[r] = (spec, shape)``."""
    bad = [(rank, out, want) for rank, (out, want) in enumerate(zip(outs, expected))
           if out is not None and (out[0] != want[0] or out[1] != want[1] or not out[2])]
    if not bad:
        return None
    listing = "; ".join(
        f"rank {rank}: needs a C-contiguous {want[0].kind} {want[0].dtype} array on {want[0].device} of shape "
        f"{want[1]}, got {'a non-contiguous ' if not out[2] else ''}{out[0].kind} {out[0].dtype} on {out[0].device} "
        f"of shape {out[1]}" for rank, out, want in bad)
    return ValueError(f"{function}: out does not fit the result on every rank: {listing}; pass out=None or such an array")


def _tiles_mismatch(reports, dim_arg, manager):
    """Return a ValueError if the ranks' (shape, spec, dims, out) tiles cannot be joined into one array, else None.

    ``dims`` (a tuple: one dim for slabs, latitude and longitude for tiles) is
    the same on every rank; along each, the tiles of one coordinate of the
    manager's grid share their extent (slabs: one rank per coordinate, any
    extents); all else is alike on every rank.
    """
    slabs = not manager.tiled
    listing = ", ".join(f"rank {r}: shape {s} {t.dtype} {'dim' if slabs else 'dims'} {d[0] if slabs else d}"
                        for r, (s, t, d, _) in enumerate(reports))
    shapes = [report[0] for report in reports]
    if len({len(s) for s in shapes}) > 1 or len({report[2] for report in reports}) > 1:
        return ValueError(f"gather_tensor needs the same number of dimensions and the same dim on every rank "
                          f"(dim={dim_arg} here), got {listing}; pass {'shards' if slabs else 'tiles'} of one array "
                          "and the same dim")
    dims = reports[0][2]
    outside = {tuple(n for i, n in enumerate(s) if i not in dims) for s in shapes}
    coords = [manager.domain_coords_of(r) for r in range(len(reports))]
    along = [{(c[k], s[d]) for c, s in zip(coords, shapes)} for k, d in enumerate(dims)]  # (coordinate, extent)
    if (len(outside) > 1 or len({report[1].dtype for report in reports}) > 1
            or any(len(pairs) != parts for pairs, parts in zip(along, manager.domain_shape))):
        return ValueError(
            f"gather_tensor needs the same dtype and the same extents outside dim {dims[0]} on every rank, got "
            f"{listing}; pass shards of one array, split only along dim" if slabs else
            f"gather_tensor needs tiles of one array: the same dtype and extents outside dims {dims}, one latitude "
            f"extent per row of tiles and one longitude extent per column, got {listing}; pass tiles that "
            f"shard_tensor(x, dim={dim_arg}) would make")
    full = list(shapes[0])
    for d, pairs in zip(dims, along):
        full[d] = sum(n for _, n in pairs)
    return _out_mismatch("gather_tensor", [report[3] for report in reports],
                         [(report[1], tuple(full)) for report in reports])


def _agreed_tiles(comm, manager, x, dim, out):
    """Check ``x``, ``dim`` and ``out`` on every rank of the domain group; return the normalised dims and,
    per dim, the extent of each coordinate's tiles. Raise on every rank otherwise; collective."""
    def describe():
        spec = devices.array_spec(x)  # first: a non-array is a TypeError here, not an AttributeError on .shape
        dims = tuple(normalize_dim(d, x.shape) for d in (dim if isinstance(dim, tuple) else (dim,)))
        if len(dims) == 2 and dims[0] >= dims[1]:
            raise ValueError(f"gather_tensor: dim={dim} must be latitude then longitude, e.g. (-2, -1)")
        return tuple(x.shape), spec, dims, _out_report(out)

    reports = _exchange_reports(comm, "gather_tensor", describe)
    error = _tiles_mismatch(reports, dim, manager)
    if error is not None:
        raise error
    dims = reports[0][2]
    extents = []
    for k, d in enumerate(dims):
        sizes = [0] * manager.domain_shape[k]
        for rank, report in enumerate(reports):
            sizes[manager.domain_coords_of(rank)[k]] = report[0][d]
        extents.append(sizes)
    return dims, extents


def gather_tensor(x, dim=None, manager=None, *, out=None):
    """Return the full array: every domain rank's shard of ``x`` joined along ``dim``.

    Collective over the domain group: call on all its ranks with the same
    ``dim`` (default: the manager's ``shard_dim``; with tiles the pair
    ``(-2, -1)``, joined by the tiles' coordinates). Every rank gets the whole array, of ``x``'s kind, dtype and
    device (an all-gather; shards may differ in extent along ``dim``, as
    ``shard_tensor(..., allow_uneven=True)`` makes them), written into
    ``out`` if given (a C-contiguous array like the result: reusing one
    saves a fresh allocation per call). Returns ``x`` itself when there is
    no manager or D=1 (CREDIT's semantics). Not differentiable. A dtype,
    number of dimensions, extent outside ``dim`` or ``out`` that does not
    fit raises ValueError on every rank.
    """
    manager = _active_manager(manager, "gather_tensor")
    if manager is None:
        devices.array_kind(x)  # a non-array is a mistake with one rank too
        return x if out is None else devices.assign(out, x)
    comm = library_comm(manager)
    dims, extents = _agreed_tiles(comm, manager, x, _agreed_dims(comm, manager, dim, "gather_tensor"), out)
    if len(dims) == 1:
        return _gather(comm, x, dims[0], extents[0], out)
    # Tiles: along longitude within each band of tiles, then along latitude.
    band = _gather(library_comm(manager, "band"), x, dims[1], extents[1], None)
    return _gather(library_comm(manager, "column"), band, dims[0], extents[0], out)


def _gather(comm, x, dim, counts, out):
    """gather_tensor's all-gather of shards of ``counts`` rows (by rank of ``comm``) along one ``dim`` over ``comm``."""
    rank = comm.Get_rank()
    offsets = list(itertools.accumulate([0] + counts[:-1]))
    full_shape = tuple(x.shape[:dim]) + (sum(counts),) + tuple(x.shape[dim + 1:])
    x = devices.contiguous(x.detach() if devices.array_kind(x) == "torch" else x)
    way = transport.transport_for(x)
    if out is None and not way.device_memory_to_mpi:
        out = devices.empty(full_shape, like=x)
    itemsize = devices.numpy_dtype(x).itemsize
    outer, row_elements = math.prod(x.shape[:dim]), math.prod(x.shape[dim + 1:])
    if outer * row_elements * sum(counts) == 0:
        return devices.empty(full_shape, like=x) if out is None else out
    row_bytes = row_elements * itemsize
    send = _row_type(row_bytes, outer * counts[rank]) if counts[rank] else None
    send_types = [send if r != rank else None for r in range(len(counts))]
    try:
        if way.device_memory_to_mpi:
            return _gather_device(comm, x, dim, counts, offsets, outer, row_elements, send_types, out)
        host_x = way.readable(x)
        recv_types = _placed_types(outer, row_bytes, counts, offsets, full_shape[dim])
        _free([recv_types[rank]])  # this rank's own rows are copied, not received
        recv_types[rank] = None
        try:
            with transport.transport_for(out).writable(out) as host_out:
                _alltoallw(comm, host_x, send_types, host_out, recv_types)
                host_out[_rows(dim, offsets[rank], offsets[rank] + counts[rank])] = host_x
        finally:
            _free(recv_types)
        return out
    finally:
        _free([send])


def _gather_device(comm, x, dim, counts, offsets, outer, row_elements, send_types, out):
    """All-gather device shards as contiguous blocks (CUDA-aware MPI), then join them on the device.

    Strided datatypes on device memory are slow in most MPI libraries; one
    device-side concatenation is cheap.
    """
    itemsize = devices.numpy_dtype(x).itemsize
    starts = [outer * offset * row_elements for offset in offsets]
    sizes = [outer * count * row_elements for count in counts]
    staging = devices.empty((sum(sizes),), like=x)
    MPI = mpi()
    recv_types = []
    for rank, (start, size) in enumerate(zip(starts, sizes)):
        if rank == comm.Get_rank() or size == 0:
            recv_types.append(None)
            continue
        block = MPI.BYTE.Create_contiguous(size * itemsize)
        recv_types.append(MPI.Datatype.Create_struct([1], [start * itemsize], [block]).Commit())
        block.Free()
    try:
        _alltoallw(comm, transport.transport_for(x).readable(x), send_types, devices.mpi_buffer(staging), recv_types)
    finally:
        _free(recv_types)
    blocks = []
    for rank, (start, size, count) in enumerate(zip(starts, sizes, counts)):
        if rank == comm.Get_rank():
            blocks.append(x)
        else:
            blocks.append(staging[start:start + size].reshape(tuple(x.shape[:dim]) + (count,) + tuple(x.shape[dim + 1:])))
    return _concatenate(blocks, dim, out)


def _scatter_plan(comm, x, dim, root, out, manager):
    """Check the arguments on every rank of the domain group; return the root's ``(spec, shape, dims)`` or raise
    on all ranks. ``dims`` is a tuple (one dim for slabs, a pair for tiles); each rank's ``out`` is checked
    against its tile."""
    rank, size = comm.Get_rank(), comm.Get_size()

    def describe():
        require_int("root", root, hint="pass a domain rank")
        if not 0 <= root < size:
            raise ValueError(f"root={root} is not a domain rank; pass a root between 0 and {size - 1}")
        plan = None
        if rank == root:
            if x is None:
                raise ValueError(
                    f"scatter_tensor got x=None on the root (domain rank {root}); the root must pass the full "
                    "array, the other ranks pass None"
                )
            dims = tuple(normalize_dim(d, x.shape) for d in (dim if isinstance(dim, tuple) else (dim,)))
            if len(dims) == 2 and dims[0] >= dims[1]:
                raise ValueError(f"scatter_tensor: dim={dim} must be latitude then longitude, e.g. (-2, -1)")
            plan = (devices.array_spec(x), tuple(x.shape), dims)
        return root, dim, plan, _out_report(out)

    reports = _exchange_reports(comm, "scatter_tensor", describe)
    if len({(r, d) for r, d, _, _ in reports}) > 1:
        listing = ", ".join(f"rank {r}: root={o} dim={d}" for r, (o, d, _, _) in enumerate(reports))
        raise ValueError(f"scatter_tensor needs the same root and dim on every rank, got {listing}")
    spec, shape, dims = reports[root][2]
    error = _out_mismatch("scatter_tensor", [report[3] for report in reports],
                          [(spec, _tile_shape(shape, dims, manager, r)) for r in range(size)])
    if error is not None:
        raise error
    return spec, shape, dims


def _tile_shape(shape, dims, manager, rank):
    """The shape of domain rank ``rank``'s tile of an array of ``shape`` split along ``dims`` as :func:`balanced_split`."""
    tile = list(shape)
    for d, parts, c in zip(dims, manager.domain_shape, manager.domain_coords_of(rank)):
        tile[d] = balanced_split(shape[d], parts)[0][c]
    return tuple(tile)


def scatter_tensor(x, dim=None, root=0, manager=None, *, out=None):
    """Return this domain rank's shard of the array that domain rank ``root`` holds.

    Collective over the domain group: call on all its ranks with the same
    ``dim`` (default: the manager's ``shard_dim``; with tiles the pair
    ``(-2, -1)``: each rank receives its tile) and ``root``; the root passes the full array, the others pass
    None (anything they pass is ignored). Each rank receives only its own
    rows, split as :func:`balanced_split` (uneven extents allowed), so the
    full array never exists off the root; the result has the root's kind and
    dtype (on this rank's current CUDA device if the root's is on a GPU),
    equals ``shard_tensor(full, dim, allow_uneven=True)``, and is written
    into ``out`` if given (a C-contiguous array like the result). Returns
    ``x`` when there is no manager or D=1. Not differentiable. None on the
    root, a bad ``root``, ``dim`` or ``out``, or ranks disagreeing on
    ``root`` or ``dim`` raise on every rank.
    """
    manager = _active_manager(manager, "scatter_tensor")
    if manager is None:
        if x is None:
            raise ValueError("scatter_tensor got x=None with no domain decomposition (no manager or D=1); pass the array")
        return x
    comm = library_comm(manager)
    dim = _agreed_dims(comm, manager, dim, "scatter_tensor")
    spec, shape, dims = _scatter_plan(comm, x, dim, root, out, manager)
    if len(dims) == 1:
        return _scatter(comm, x, spec, shape, dims[0], root, out)
    # Tiles: along latitude within the root's column of tiles, then along longitude within each band.
    lat, lon = dims
    root_lat, root_lon = manager.domain_coords_of(root)
    i_lat, i_lon = manager.domain_coords
    slab = _scatter(library_comm(manager, "column"), x, spec, shape, lat, root_lat, None) if i_lon == root_lon else None
    band = shape[:lat] + (balanced_split(shape[lat], manager.domain_shape[0])[0][i_lat],) + shape[lat + 1:]
    return _scatter(library_comm(manager, "band"), slab, spec, band, lon, root_lon, out)


def _scatter(comm, x, spec, shape, dim, root, out):
    """scatter_tensor of an array of ``spec`` and ``shape`` (``x`` on the root) along one ``dim`` over ``comm``
    from its rank ``root``."""
    rank = comm.Get_rank()
    counts, offsets = balanced_split(shape[dim], comm.Get_size())
    outer, row_elements = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    row_bytes = row_elements * _itemsize(spec)
    if rank == root:
        x = x.detach() if spec.kind == "torch" else x
        if out is None:
            out = _copy_rows(x, dim, offsets[rank], counts[rank])
        else:
            out[...] = x[_rows(dim, offsets[rank], offsets[rank] + counts[rank])]
        if outer * row_bytes * shape[dim]:
            _scatter_send(comm, x, dim, counts, offsets, outer, row_bytes)
        return out
    if out is None:
        out = devices.empty(shape[:dim] + (counts[rank],) + shape[dim + 1:], spec)
    if outer * row_bytes * counts[rank] == 0:
        return out
    with transport.transport_for(out).writable(out) as memory:
        wait_all([comm.Irecv([memory, mpi().BYTE], source=root, tag=_SCATTER_TAG)], comm=comm, call="scatter_tensor",
                 awaiting=[f"its rows from the root (rank {root} of the group)"])
    return out


def _itemsize(spec):
    return np.dtype("uint16" if spec.dtype == "bfloat16" else spec.dtype).itemsize


def _scatter_send(comm, x, dim, counts, offsets, outer, row_bytes):
    """On the root: send every other rank its rows as contiguous bytes."""
    MPI = mpi()
    rank = comm.Get_rank()
    others = [r for r in range(comm.Get_size()) if r != rank and counts[r]]
    way = transport.transport_for(x)
    if way.device_memory_to_mpi:
        # CUDA-aware: pack each shard on the device; strided datatypes on device memory are slow.
        chunks = [_copy_rows(x, dim, offsets[r], counts[r]) for r in others]
        way.synchronize(x)
        requests = [comm.Isend([devices.mpi_buffer(c), MPI.BYTE], dest=r, tag=_SCATTER_TAG) for r, c in zip(others, chunks)]
        _wait_for_receivers(comm, requests, others)
        return
    source = way.readable(devices.contiguous(x))
    types = _placed_types(outer, row_bytes, counts, offsets, sum(counts))
    try:
        requests = [comm.Isend([source, 1, types[r]], dest=r, tag=_SCATTER_TAG) for r in others]
        _wait_for_receivers(comm, requests, others)
    finally:
        _free(types)


def _wait_for_receivers(comm, requests, ranks):
    """On the root: wait (at most ``MPIDOMAIN_TIMEOUT``) until ``ranks`` took their rows."""
    wait_all(requests, comm=comm, call="scatter_tensor",
             awaiting=[f"rank {r} of the group to take its rows" for r in ranks])

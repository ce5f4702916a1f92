"""This rank's tile of a lazy xarray Dataset or DataArray, halos included: ``select_tile``.

The selection stays lazy: nothing is read until ``.values`` or ``.load()``,
and then only the rows and columns the tile and its halos need (so only the
store's chunks they touch). The rows and columns come from
:class:`~mpidomain.data.window.TileWindow`, the halo engine's arithmetic.
"""

import itertools

import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from .._agreement import agree
from .._errors import digest
from .._current import require_manager
from ..manager import library_comm
from .window import tile_window

__all__ = ["select_tile"]


class _PaddedArray(BackendArray):
    """A lazy variable's padded tile: reads only the global rows and columns its :class:`TileWindow` names."""

    def __init__(self, variable, window, lat, lon):
        self._variable, self._window = variable, window
        self._lat = variable.dims.index(lat) if lat in variable.dims else None
        self._lon = variable.dims.index(lon) if lon in variable.dims else None
        shape = list(variable.shape)
        for axis, n in ((self._lat, len(window.rows)), (self._lon, len(window.columns))):
            if axis is not None:
                shape[axis] = n
        self.shape, self.dtype = tuple(shape), variable.dtype
        # Where the store keeps whole rows of longitudes in a chunk, any columns of a row cost the same chunks.
        encoding = variable.encoding
        chunks = encoding.get("chunks") or encoding.get("chunksizes") or encoding.get("preferred_chunks")
        if isinstance(chunks, dict):
            chunks = tuple(chunks.get(d, n) for d, n in zip(variable.dims, variable.shape))
        self._whole_rows = self._lon is None or not chunks or chunks[self._lon] >= variable.shape[self._lon]

    def __getitem__(self, key):
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.BASIC, self._read)

    def _read(self, key):
        """Return the padded tile's ``key`` (ints and slices, one per dim) as a NumPy array; zeros where no row is."""
        key = tuple(key) + (slice(None),) * (len(self.shape) - len(key))
        dropped = [axis for axis, k in enumerate(key) if not isinstance(k, slice)]
        key = tuple(k if isinstance(k, slice) else slice(k, k + 1) for k in key)
        out = np.zeros([len(range(*k.indices(n))) for k, n in zip(key, self.shape)], self.dtype)
        for read in self._reads(key):
            source = list(key)
            for axis in read[0][1]:
                source[axis] = _readable(np.concatenate([wanted[axis] for _, wanted in read]))
            block = np.asarray(self._variable[tuple(source)].values)
            for target, wanted in read:  # copied run by run: slices, no index arrays
                axes = sorted(target)
                runs = [_runs(target[a], _positions(source[a], wanted[a])) for a in axes]
                for combination in itertools.product(*runs):
                    into, taken = [slice(None)] * out.ndim, [slice(None)] * out.ndim
                    for axis, (to, of) in zip(axes, combination):
                        into[axis], taken[axis] = to, of
                    out[tuple(into)] = block[tuple(taken)]
        return out.squeeze(axis=tuple(dropped)) if dropped else out

    def _reads(self, key):
        """The reads ``key`` needs: lists of (padded positions, their global rows/columns), each ``{axis: array}``.

        The rows beyond a pole take their columns half a turn away; they share a read with the others
        where they need the same columns (on slabs: all of them) or the store's chunks hold whole rows
        of longitudes (or the data is in memory), else get their own.
        """
        window, lat, lon = self._window, self._lat, self._lon
        if lat is None:
            groups = [(None, window.columns)]
        else:
            rows = np.arange(self.shape[lat])[key[lat]]
            global_rows = np.asarray(window.rows)[rows]
            if lon is None or window.columns == window.turned_columns:
                groups = [(np.arange(len(rows)), window.columns)]
            else:
                mirrored = np.asarray(window.mirrored)[rows]
                groups = [(np.flatnonzero(~mirrored), window.columns), (np.flatnonzero(mirrored), window.turned_columns)]
        parts = []  # per group: the padded positions to fill and the global rows/columns they hold, per axis
        for positions, column_map in groups:
            target, wanted = {}, {}
            if lat is not None:
                positions = positions[global_rows[positions] >= 0]
                target[lat], wanted[lat] = positions, global_rows[positions]
            if lon is not None:
                global_columns = np.asarray(column_map)[np.arange(self.shape[lon])[key[lon]]]
                target[lon] = np.flatnonzero(global_columns >= 0)
                wanted[lon] = global_columns[target[lon]]
            if all(len(p) for p in target.values()):
                parts.append((target, wanted))
        reads = []
        for part in parts:
            same = [r for r in reads if self._whole_rows or set(r[0][1][lon]) == set(part[1][lon])]
            if same:
                same[0].append(part)
            else:
                reads.append([part])
        return reads


def _runs(target, source):
    """Split the pairs ``(target[i], source[i])`` into runs where ``target`` steps by 1 and ``source`` by 1 or -1
    (mirrored rows): a list of (target slice, source slice)."""
    runs, i, n = [], 0, len(target)
    while i < n:
        j, step = i + 1, None
        while j < n and target[j] == target[j - 1] + 1 and source[j] - source[j - 1] in ((step,) if step else (1, -1)):
            step, j = source[j] - source[j - 1], j + 1
        step = step or 1
        stop = int(source[j - 1]) + step
        runs.append((slice(int(target[i]), int(target[j - 1]) + 1),
                     slice(int(source[i]), stop if stop >= 0 else None, step)))
        i = j
    return runs


def _readable(indices):
    """What to read for global ``indices`` (any order, repeats allowed): a slice where the distinct ones are
    consecutive, else the sorted distinct indices."""
    unique = np.unique(indices)
    if unique[-1] - unique[0] + 1 == len(unique):
        return slice(int(unique[0]), int(unique[-1]) + 1)
    return unique


def _positions(read, indices):
    """Where each of the global ``indices`` lies in what :func:`_readable` read."""
    return indices - read.start if isinstance(read, slice) else np.searchsorted(read, indices)


def _coordinate(variable, mapping):
    """An index coordinate's values at the global ``mapping`` (NaN where -1: a halo of zeros)."""
    mapping = np.asarray(mapping, dtype=np.int64)
    values = np.asarray(variable.values)[np.maximum(mapping, 0)]
    if (mapping < 0).any():
        values = values.astype(np.result_type(values.dtype, np.float32))
        values[mapping < 0] = np.nan
    return xr.Variable(variable.dims, values, attrs=variable.attrs)


def _select(variable, name, window, lat, lon):
    """``variable`` of the dataset cut to the window: lazily, or at once for the latitude and longitude coordinates."""
    if name == lat and variable.dims == (lat,):
        return _coordinate(variable, window.rows)
    if name == lon and variable.dims == (lon,):
        return _coordinate(variable, window.columns)
    if lat not in variable.dims and lon not in variable.dims:
        return variable
    return xr.Variable(variable.dims, indexing.LazilyIndexedArray(_PaddedArray(variable, window, lat, lon)),
                       attrs=variable.attrs)


def _grid(manager):
    """The manager's ``domain_shape`` and ``domain_coords``: one rank's whole field (slabs of one) if None."""
    return ((1,), (0,)) if manager is None else (manager.domain_shape, manager.domain_coords)


def _describe(data, lat, lon):
    """What every rank of the domain group must have alike: the dims, the variables, the coordinates' values."""
    if not isinstance(data, (xr.Dataset, xr.DataArray)):
        raise TypeError(f"select_tile takes an xarray.Dataset or xarray.DataArray (e.g. xarray.open_zarr(path) or "
                        f"xarray.open_dataset(path)), got {type(data).__name__}")
    dims = dict(data.sizes)
    for what, name in (("lat", lat), ("lon", lon)):
        if name not in dims:
            raise ValueError(f"select_tile: {what}={name!r} is not a dim of the data, whose dims are {list(dims)}; "
                             f"pass {what}= the name of its {'latitude' if what == 'lat' else 'longitude'} dim")
    if lat in data.coords:
        values = np.asarray(data[lat].values)
        steps = np.sign(np.diff(values.astype(np.float64)))
        if len(steps) and not (np.all(steps > 0) or np.all(steps < 0)):
            bad = int(np.flatnonzero(steps != steps[0])[0]) + 1
            raise ValueError(f"select_tile: the latitude coordinate {lat!r} is not monotonic ({values[bad - 1]!r} then "
                             f"{values[bad]!r} at index {bad}); sort it first, e.g. data.sortby({lat!r}, ascending=False)")
    variables = data.variables.items() if isinstance(data, xr.Dataset) else \
        [(data.name, data.variable)] + list(data.coords.variables.items())
    coordinates = [np.asarray(data[n].values).tobytes() for n in (lat, lon) if n in data.coords]
    return {
        "dims": dict(sorted(dims.items())),  # a store's listing may order them differently on each rank
        "variables": digest(sorted((str(n), v.dims, v.shape, str(v.dtype)) for n, v in variables)),
        "coordinates": digest(coordinates),
    }


def _mismatch(descriptions):
    """The ValueError for ranks whose data or arguments differ: each field that differs, rank by rank."""
    problems = []
    for field in ("arguments", "dims", "variables", "coordinates"):
        values = [d[field] for d in descriptions]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            problems.append(f"{field} differ: {listing}")
    if not problems:
        problems = [f"rank {r}: {d}" for r, d in enumerate(descriptions)]
    return ValueError("select_tile needs the same data and arguments on every rank of the domain group (did a rank "
                      "open another file?):\n  " + "\n  ".join(problems))


def select_tile(data, manager=None, *, halo=0, boundary=None, periodic=False, lat="latitude", lon="longitude"):
    """Return this rank's tile of the lazy ``data`` with ``halo`` rows and columns around it, still lazy.

    Collective over the domain group: call on every rank of the group with the
    same data (the same file opened on each) and arguments. Each rank gets an
    object of ``data``'s type, its variables cut to the tile ``shard_tensor``
    would give it along ``lat`` x ``lon`` (latitude slabs of a manager with
    ``shard_dim=-2``, or tiles of a ``(D_lat, D_lon)`` manager with
    ``shard_dim=(-2, -1)``; uneven splits as :func:`mpidomain.balanced_split`),
    widened by the halos and filled exactly as :func:`mpidomain.halo_exchange`
    fills them: ``select_tile(data, halo=h)`` equals ``halo_exchange`` of
    ``select_tile(data)``'s values, bit for bit. So zeros beyond the edges; the
    wrapped columns (or rows) with ``periodic``; with ``boundary="earth"`` the
    longitude wrapped and, beyond a pole, the rows next to it mirrored and
    taken half a turn (``W // 2`` columns) away. As there, an int ``halo``
    pads both dims on tiles or with the Earth, latitude only on slabs; a pair
    is (latitude, longitude). Variables without ``lat`` and ``lon`` are kept;
    the ``lat``/``lon`` coordinates hold the values of the rows and columns
    each padded one copies (NaN where zeros; unturned longitudes beyond a pole).

    Nothing is read until ``.values``/``.load()`` (also of a part, e.g.
    ``.isel(time=0)``), and then only the global rows and columns the tile and
    its halos hold: the store's chunks they touch. With no manager in a
    one-process job, the whole field is the tile. One agreement step (an
    Allreduce of a few integers) checks the ranks' data and arguments: a
    manager that shards other dims, a missing ``lat``/``lon``, a latitude that is not monotonic, a halo wider
    than a tile, ``boundary="earth"`` with ``periodic``, or data whose dims,
    variables or coordinates differ between ranks raise on every rank.

    :param data: An ``xarray.Dataset`` or ``DataArray``, lazily opened (e.g. ``xarray.open_zarr``).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param halo: Ghost rows/columns on each side: an int or ``(lat, lon)``.
    :param boundary: ``None`` or ``"earth"``.
    :param periodic: Wrap around the field's edges: a flag or ``(lat, lon)``.
    :param lat: The latitude dim's name.
    :param lon: The longitude dim's name.
    """
    manager = require_manager(manager, "select_tile", alone_ok=True)
    grid, coords = _grid(manager)
    error = window = description = None
    try:
        if manager is not None and manager.shard_dims not in ((-2,), (-2, -1)):
            raise ValueError(f"select_tile splits latitude (slabs: shard_dim=-2) or latitude x longitude (tiles: "
                             f"shard_dim=(-2, -1)), but the manager shards dims {manager.shard_dims}; build the manager "
                             "with shard_dim=-2 or (-2, -1)")
        description = _describe(data, lat, lon)
        description["arguments"] = (halo, periodic, boundary, lat, lon)
        window = tile_window((data.sizes[lat], data.sizes[lon]), grid, coords, halo, periodic, boundary)
    except (TypeError, ValueError) as exc:
        error = exc
    if manager is not None:
        agree(library_comm(manager), "select_tile", description, error=error, mismatch=_mismatch)
    elif error is not None:
        raise error
    if isinstance(data, xr.DataArray):
        coordinates = {n: _select(v, n, window, lat, lon) for n, v in data.coords.variables.items()}
        return xr.DataArray(_select(data.variable, data.name, window, lat, lon), coords=coordinates,
                            name=data.name, attrs=data.attrs)
    cut = {n: _select(v, n, window, lat, lon) for n, v in data.variables.items()}
    return xr.Dataset({n: cut[n] for n in data.data_vars}, coords={n: cut[n] for n in data.coords}, attrs=data.attrs)

"""Write each rank's tile into one Zarr store, all ranks of a domain group together: ``write_tile``.

The way back of :func:`~mpidomain.data.select_tile`: every rank holds its tile
(no halos) with its own latitude and longitude coordinates, and together they
write the whole field, each rank only the bytes of the chunks it writes. The
steps, each over the library's own domain communicator:

1. every rank checks its tile and arguments, encodes its variables as
   xarray's Zarr writer does (with each variable's encoding, or the store's
   where it has the variable), and reads the store's metadata (if any:
   :func:`~mpidomain.data.write_commit.read_store`, each array's own, and
   what a killed call left);
2. one agreement step compares what must be alike on every rank (arguments,
   variables, dims, dtypes, attributes, the values of variables without
   latitude or longitude, the store's metadata), then one allgather brings
   every rank's latitude and longitude vectors: every rank checks the same
   layout (:mod:`~mpidomain.data.write_layout`), and the appended steps
   against the store's last, and raises the same error, before any byte is
   written;
3. for a new store, domain rank 0 creates its arrays (metadata only, with
   zarr's own API: no full-size array anywhere) and the latitude and
   longitude coordinates, but not the group's ``zarr.json``;
4. each chunk has one writer, the rank holding its first row and column:
   the others send it their rows of that chunk, and it writes whole chunks,
   appended steps beyond the arrays' stored shapes, where no reader sees them;
5. once every rank has written, domain rank 0 commits
   (:func:`~mpidomain.data.write_commit.commit`): the arrays' new shapes,
   the ``append_dim`` coordinate's last, then the consolidated metadata; or
   a new store's ``zarr.json``.

So no write is lost or raced whatever the chunks, a store written by D ranks
holds the same bytes, chunk file for chunk file, as one written by one, and a
call that fails or is killed before its commit leaves the store's steps as
they were.
"""

import hashlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import pandas as pd
import xarray as xr
import zarr
from xarray.backends.zarr import FillValueCoder, encode_zarr_attr_value, encode_zarr_variable
from zarr.storage import LocalStore, WrapperStore

from .._agreement import agree
from .._mpi import mpi
from .._waits import wait_all
from .._current import require_manager
from .._validate import is_int
from ..manager import library_comm
from .write_commit import PlannedArray, commit, create_arrays, open_writers, read_store
from .write_layout import AxisSplit, absent_axis, block_moves, place_tiles, tile_coordinates

__all__ = ["write_tile"]

_TAG = 23731  # write_tile's messages on the library's domain communicator
_PIECE = 1 << 30  # at most this many bytes per message (MPI counts are C ints)
_ALLOWED = "biufc"  # dtypes a tile's variables may hold (datetimes too where neither latitude nor longitude)
# The encoding keys xarray's Zarr writer honours that change what is stored (chunks apart, see _encoded_chunks).
_ENCODING = ("dtype", "scale_factor", "add_offset", "_FillValue", "missing_value", "units", "calendar")
_PACKING = ("scale_factor", "add_offset")


@dataclass(frozen=True)
class _Settings:
    """The arguments of one call, checked: they travel together through every step."""

    lat: str
    lon: str
    append_dim: Optional[str]
    chunks: Tuple[Tuple[str, int], ...]
    store: Any
    store_name: str
    root: Optional[str]  # the store's local folder, None for other stores


def _fingerprint(values):
    """A digest of an array's dtype, shape and bytes."""
    values = np.ascontiguousarray(values)
    hashed = hashlib.blake2b(f"{values.dtype.str}{values.shape}".encode(), digest_size=12)
    hashed.update(values.reshape(-1).view(np.uint8).data)
    return hashed.hexdigest()


def _store_of(path):
    """The store argument as zarr opens it, a name that is alike on every rank writing the same store, and its local
    folder (None if it is no local folder)."""
    if isinstance(path, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(path))
        return path, path, path
    if isinstance(path, zarr.abc.store.Store):
        inner = path
        while isinstance(inner, WrapperStore):
            inner = inner._store
        root = os.path.abspath(inner.root) if isinstance(inner, LocalStore) else None
        return path, root if root is not None else str(path), root
    raise TypeError(f"write_tile: path must be a Zarr store's path (str or os.PathLike) or a zarr Store, got "
                    f"{type(path).__name__}; e.g. write_tile(tile, 'out.zarr', manager)")


def _settings(tile, path, lat, lon, append_dim, chunks):
    """Check the arguments this rank passed; return :class:`_Settings`."""
    if not isinstance(tile, xr.Dataset):
        raise TypeError(f"write_tile: tile must be an xarray.Dataset holding this rank's tile, got "
                        f"{type(tile).__name__}; for a DataArray pass da.to_dataset(name='...')")
    for what, name in (("lat", lat), ("lon", lon)):
        if name not in tile.dims or name not in tile.coords or tile[name].dims != (name,):
            raise ValueError(f"write_tile: {what}={name!r} must be a dim of the tile with a 1-d coordinate (its "
                             f"values place the tile in the field), but the tile's dims are {list(tile.dims)} and "
                             f"its coordinates {list(tile.coords)}; pass {what}= the name of that dim, or assign its "
                             f"coordinate, e.g. tile.assign_coords({name}=values)")
    if append_dim is not None and (append_dim not in tile.dims or append_dim in (lat, lon)):
        raise ValueError(f"write_tile: append_dim={append_dim!r} must be a dim of the tile other than {lat!r} and "
                         f"{lon!r}, but the tile's dims are {list(tile.dims)}; pass append_dim= e.g. 'time', or None "
                         "to overwrite the store")
    if chunks is not None and not isinstance(chunks, dict):
        raise TypeError(f"write_tile: chunks must be a dict {{dim: size}} or None, got {type(chunks).__name__}; "
                        "e.g. chunks={'latitude': 5}")
    for dim, size in (chunks or {}).items():
        if dim not in tile.dims:
            raise ValueError(f"write_tile: chunks names the dim {dim!r}, but the tile's dims are {list(tile.dims)}; "
                             "give chunk sizes of the tile's dims only")
        if not is_int(size):
            raise TypeError(f"write_tile: chunks[{dim!r}] must be an int, got {size!r} ({type(size).__name__})")
        if size < 1:
            raise ValueError(f"write_tile: chunks[{dim!r}] must be >= 1, got {size}; give each chunked dim a "
                             "chunk of at least one row")
    store, name, root = _store_of(path)
    return _Settings(lat, lon, append_dim, tuple(sorted((str(d), int(n)) for d, n in (chunks or {}).items())),
                     store, name, root)


def _stored_variable(name, stored, values):
    """``values`` of the store's array ``name`` as an (encoded) xarray Variable with its attributes."""
    dtype = np.dtype(stored["dtype"])
    attrs = dict(stored["attrs"])
    if "_FillValue" in attrs:
        attrs["_FillValue"] = FillValueCoder.decode(attrs["_FillValue"], dtype)
    return xr.Variable(stored["dims"], np.asarray(values, dtype), attrs)


def _stored_encoding(name, stored):
    """The encoding an append keeps from the store's array (as xarray's appends keep it): its CF attributes, and
    its dtype where it packs values (scale_factor, add_offset) or holds times."""
    empty = _stored_variable(name, stored, np.zeros((0,) * len(stored["dims"])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoding = xr.conventions.decode_cf_variable(name, empty, decode_timedelta=True).encoding
    keep = {k: v for k, v in encoding.items() if k in _ENCODING}
    if not any(k in keep for k in _PACKING) and "units" not in keep:
        keep.pop("dtype", None)
    return keep


def _decoded_last(name, stored, last):
    """The store's last committed value of the coordinate ``name`` (stored as ``last``), decoded."""
    variable = _stored_variable(name, stored, [last])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return xr.conventions.decode_cf_variable(name, variable, decode_timedelta=True).values[0]


def _encode(variable, name, settings, state):
    """Return ``(values, attrs, fill_value)``: ``variable`` as xarray's Zarr writer stores it."""
    distributed = settings.lat in variable.dims or settings.lon in variable.dims
    if variable.dtype.kind not in (_ALLOWED if distributed else _ALLOWED + "mM"):
        allowed = ("numbers (bool, int, float, complex) where a variable has latitude or longitude" if distributed
                   else "numbers, datetimes and timedeltas")
        raise TypeError(f"write_tile: tile[{name!r}] has dtype {variable.dtype}, but write_tile writes {allowed}; "
                        f"convert it, e.g. tile[{name!r}].astype('float32'), or leave it out of the tile")
    times = variable.dtype.kind in "mM"
    fill_value = variable.encoding.get("fill_value")  # zarr's fill value of a new array, as xarray takes it
    encoding = {k: v for k, v in variable.encoding.items() if k in _ENCODING and (times or k not in ("units",
                                                                                                   "calendar"))}
    if state is not None and name in state:
        encoding.update(_stored_encoding(name, state[name]))
    variable = variable.copy(deep=False)
    variable.encoding = dict(encoding)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # units xarray cannot keep: raised below instead
        encoded = encode_zarr_variable(variable, name=name, zarr_format=3)
        units = encoded.attrs.get("units", "")
        if (variable.dtype.kind == "M" and "units" not in encoding and name == settings.append_dim
                and units.startswith("days since")):
            # a store that grows along time gets steps finer than the first call's: hours, unless told otherwise
            variable.encoding = dict(encoding, units=f"hours since {pd.Timestamp(units[len('days since '):])}")
            encoded = encode_zarr_variable(variable, name=name, zarr_format=3)
    requested = variable.encoding.get("units")
    if requested is not None:  # xarray may take other units where these cannot hold the values: check they do
        kept = xr.Variable(encoded.dims, encoded.values, dict(encoded.attrs, units=requested))
        decoded = xr.conventions.decode_cf_variable(name, kept, decode_timedelta=True).values
        original = variable.values
        same = (decoded == original) | (np.isnat(decoded) & np.isnat(original))
        if decoded.shape != original.shape or not np.all(same):
            source = "the store's" if state is not None and name in state else "its encoding's"
            raise ValueError(f"write_tile: tile[{name!r}]'s values cannot be stored exactly in {source} units "
                             f"{requested!r} (they need {encoded.attrs.get('units')!r}); write to a new path, "
                             f"setting tile[{name!r}].encoding['units'] fine enough for every value, e.g. "
                             "'minutes since 1970-01-01'")
        if requested != encoding.get("units") or (state is not None and name in state):
            encoded.attrs["units"] = requested  # the store's spelling, or hours; xarray's of the tile's own units
    dtype = encoded.dtype
    attrs = {k: encode_zarr_attr_value(v) for k, v in encoded.attrs.items() if k != "_FillValue"}
    if encoded.attrs.get("_FillValue") is not None:
        attrs["_FillValue"] = FillValueCoder.encode(encoded.attrs["_FillValue"], dtype)
    if fill_value is None and dtype.kind == "f":
        fill_value = float("nan")  # as xarray: NaN for floats, zarr's default else
    return np.asarray(encoded.values), attrs, fill_value


@dataclass(frozen=True)
class _Local:
    """What this rank brings: its encoded variables and what the agreement and the layout compare."""

    values: Any  # {name: encoded ndarray}
    variables: Any  # {name: (dims, dtype, shape with None along lat/lon, attrs, fill_value, encoding's chunks)}
    group_attrs: Any
    store: Any  # the store's StoreState (write_commit.read_store), None if there is none yet
    state: Any  # its arrays: {name: dict}, None for a new store
    appended: Any  # the tile's values of append_dim's coordinate (None without append_dim or that coordinate)
    coordinates: Any  # the tile's latitude and longitude variables (their attributes and encoding)
    description: Any
    placement: Any


def _encoded_chunks(variable, name):
    """The chunks ``variable.encoding`` asks for, as a tuple (None if none): as xarray, one int for every dim, and
    a tuple of another length than the dims' is thrown away."""
    chunks = variable.encoding.get("chunks")
    if is_int(chunks):
        chunks = (chunks,) * variable.ndim
    if not isinstance(chunks, (tuple, list)) or len(chunks) != variable.ndim:
        return None
    if not all(is_int(c) and c >= 1 for c in chunks):
        raise ValueError(f"write_tile: tile[{name!r}].encoding['chunks'] is {chunks!r}, but chunk sizes are ints "
                         f">= 1, one per dim {variable.dims}; fix or drop the encoding's 'chunks'")
    return tuple(int(c) for c in chunks)


def _local(tile, settings):
    """Encode this rank's tile, read the store's metadata, and describe both."""
    lat, lon, append_dim = settings.lat, settings.lon, settings.append_dim
    store = read_store(settings.store, settings.root, append_dim, settings.store_name)
    state = None if store is None else store.arrays
    variables, group_attrs = xr.conventions.encode_dataset_coordinates(tile)
    values, described, alike, row, column = {}, {}, {}, {}, {}
    for name in sorted(variables, key=str):
        variable = variables[name]
        data, attrs, fill_value = _encode(variable, str(name), settings, state)
        shape = tuple(None if d in (lat, lon) else n for d, n in zip(variable.dims, data.shape))
        described[str(name)] = (tuple(str(d) for d in variable.dims), data.dtype.str, shape, attrs, fill_value,
                                _encoded_chunks(variable, str(name)))
        if name in (lat, lon):
            continue
        values[str(name)] = data
        if lat not in variable.dims and lon not in variable.dims:
            alike[str(name)] = _fingerprint(data)
        elif lon not in variable.dims:
            row[str(name)] = _fingerprint(data)
        elif lat not in variable.dims:
            column[str(name)] = _fingerprint(data)
    group_attrs = {str(k): encode_zarr_attr_value(v) for k, v in group_attrs.items()}
    appended = None
    if append_dim is not None and append_dim in variables and variables[append_dim].dims == (append_dim,):
        appended = np.asarray(variables[append_dim].values)
    description = {
        "arguments": f"lat={lat!r}, lon={lon!r}, append_dim={append_dim!r}, "
                     f"chunks={dict(settings.chunks)!r}, path={settings.store_name!r}",
        "variables": {n: (d[0], d[1], d[2]) for n, d in described.items()},
        "attributes": {n: repr((d[3], d[4], d[5])) for n, d in described.items()} | {
            "(the tile's)": repr(group_attrs)},
        "values": alike,
        "store": None if store is None else hashlib.blake2b(store.summary().encode(), digest_size=12).hexdigest(),
    }
    placement = (np.asarray(variables[lat].values), np.asarray(variables[lon].values), row, column)
    return _Local(values, described, group_attrs, store, state, appended,
                  {lat: variables[lat], lon: variables[lon]}, description, placement)


def _mismatch(descriptions):
    """The ValueError for ranks of one domain group that passed different tiles or arguments."""
    problems = []
    for field in ("arguments", "variables", "attributes", "values", "store"):
        values = [d[field] for d in descriptions]
        if all(v == values[0] for v in values):
            continue
        if isinstance(values[0], dict):
            names = sorted(set().union(*values), key=str)
            differ = [n for n in names if any(v.get(n) != values[0].get(n) for v in values)]
            if field == "variables":
                listing = "; ".join(f"rank {r}: " + ", ".join(
                    f"{n}{tuple(v[n][0])} {np.dtype(v[n][1])}" for n in sorted(v) if n in differ) for r, v in
                    enumerate(values))
                problems.append(f"the variables (names, dims, dtypes, extents but latitude and longitude) differ "
                                f"in {differ}: {listing}")
            else:
                what = "attributes" if field == "attributes" else "values (a variable without latitude or longitude)"
                problems.append(f"the {what} of {differ} differ between ranks")
        elif field == "store":
            problems.append("the store's metadata differs between ranks (is the path on a file system every rank "
                            "sees alike?)")
        else:
            problems.append("the arguments differ: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    return ValueError("write_tile: tile: every rank of the domain group must pass the same arguments and a tile of "
                      "the same dataset (variables, dims, dtypes, attributes; values alike where a variable has "
                      "neither latitude nor longitude), but:\n  " + "\n  ".join(problems) +
                      "\nbuild each rank's tile from the same dataset, e.g. select_tile(ds, manager, halo=0), and "
                      "pass the same path and arguments on every rank")


def _check_shared(gathered, grid, axis):
    """Raise ValueError unless the ranks of each tile row (axis 0) or column (axis 1) hold the same values of the
    variables that lack the other dim."""
    for index in range(grid[axis]):
        ranks = [r for r in range(len(gathered)) if divmod(r, grid[1])[axis] == index]
        first = gathered[ranks[0]][2 + axis]
        for rank in ranks[1:]:
            differ = sorted(n for n in first if gathered[rank][2 + axis][n] != first[n])
            if differ:
                what = ("row", "longitude") if axis == 0 else ("column", "latitude")
                raise ValueError(f"write_tile: tile: ranks {ranks[0]} and {rank} are in tile {what[0]} {index} but "
                                 f"hold different values of {differ}, which have no {what[1]} dim: every tile of a "
                                 f"{what[0]} holds the same rows of them; cut each rank's tile from the same dataset, "
                                 "e.g. select_tile(ds, manager, halo=0)")


def _check_store(local, settings, lat_values, lon_values, shapes):
    """Raise ValueError where the tiles disagree with the existing store (variables, dims, dtypes, extents,
    coordinates, chunks; the shapes committed); ``lat_values`` and ``lon_values`` are encoded."""
    state, lat, lon, where = local.state, settings.lat, settings.lon, f"the store at {settings.store_name!r}"
    fix = "write to a new path, or pass tiles of the dataset the store holds"
    names, stored = set(local.variables), set(state)
    if names != stored:
        raise ValueError(f"write_tile: tile: the tiles hold the variables {sorted(names)}, but {where} holds "
                         f"{sorted(stored)} (missing: {sorted(stored - names)}, extra: {sorted(names - stored)}); "
                         f"{fix}")
    for name, (dims, dtype, *_) in sorted(local.variables.items()):
        array = state[name]
        if array["dims"] != dims or np.dtype(array["dtype"]) != np.dtype(dtype):
            raise ValueError(f"write_tile: tile: tile[{name!r}] has dims {dims} and dtype {np.dtype(dtype)}, but "
                             f"{where} holds it with dims {array['dims']} and dtype {array['dtype']}; {fix}")
        expected = tuple(n if d == settings.append_dim else shapes[name][k] for k, (d, n) in
                         enumerate(zip(dims, array["committed"])))
        if expected != array["committed"] and name not in (lat, lon):
            raise ValueError(f"write_tile: tile: the tiles of {name!r} make an array of shape {shapes[name]} "
                             f"(dims {dims}), but {where} holds shape {array['committed']}"
                             f"{'' if settings.append_dim is None else f' (growing along {settings.append_dim!r})'}; "
                             f"{fix}")
    for name, values in ((lat, lat_values), (lon, lon_values)):
        if not np.array_equal(state[name]["values"], values):
            stored = state[name]["values"]
            where_differ = ("different lengths" if len(stored) != len(values) else
                            f"first difference at index {int(np.flatnonzero(stored != values)[0])}")
            raise ValueError(f"write_tile: tile: the tiles' {name!r} coordinates ({len(values)} values from "
                             f"{values[0]!r} to {values[-1]!r}) differ from {where}'s ({len(stored)} values, "
                             f"{where_differ}); {fix}")
    for name, data in sorted(local.values.items()):
        dims = local.variables[name][0]
        if dims == (name,) and name != settings.append_dim and not np.array_equal(state[name]["values"], data):
            raise ValueError(f"write_tile: tile: the tiles' {name!r} coordinate {data.tolist()[:8]} differs from "
                             f"{where}'s {state[name]['values'].tolist()[:8]}; {fix}")
    for dim, size in settings.chunks:
        for name, (dims, *_) in sorted(local.variables.items()):
            if dim in dims and dims != (name,) and state[name]["chunks"][dims.index(dim)] != size:
                raise ValueError(f"write_tile: chunks={dict(settings.chunks)} gives {dim!r} chunks of {size}, but "
                                 f"{where} chunks {name!r} by {state[name]['chunks'][dims.index(dim)]} along "
                                 f"{dim!r}: a store keeps its chunks; drop chunks= (or write to a new path)")


def _show_values(values):
    """Values of a coordinate for a message: datetimes as ISO strings, at most 6."""
    shown = [str(v) for v in np.asarray(values).reshape(-1)[:6]]
    return "[" + ", ".join(shown) + (", ..." if np.size(values) > 6 else "") + "]"


def _check_appended(local, settings):
    """Raise ValueError unless the appended steps' coordinate values run strictly increasing, after the store's last
    committed one."""
    dim, values = settings.append_dim, local.appended
    if values is None:
        return
    if values.dtype.kind not in "iufmM":
        raise ValueError(f"write_tile: tile: append_dim={dim!r} has a coordinate of dtype {values.dtype}; appended "
                         f"steps need ordered values (numbers, datetimes): give tile[{dim!r}] such values")
    if len(values) > 1 and not np.all(values[1:] > values[:-1]):
        raise ValueError(f"write_tile: tile: the appended {dim!r} values {_show_values(values)} must be strictly "
                         f"increasing (no repeats, in order, no NaT); append each step once, in order")
    if local.store is None or local.state is None or local.store.last is None:
        return
    last = _decoded_last(dim, local.state[dim], local.store.last)
    if np.asarray(last).dtype.kind in "mM" and np.isnat(last):
        return
    comparable = (values.dtype.kind in "mM") == (np.asarray(last).dtype.kind in "mM")
    if not comparable or not values[0] > last:
        raise ValueError(f"write_tile: tile: the appended {dim!r} values {_show_values(values)} are not after the "
                         f"store's last, {last} (the store at {settings.store_name!r} holds "
                         f"{local.state[dim]['committed'][0]} steps): each call appends steps strictly after those "
                         "the store holds, once; append the next steps (to overwrite steps the store holds, write "
                         "without append_dim, or to a new path)")


def _plan(local, gathered, settings, grid):
    """Every array this call writes (a list of :class:`~mpidomain.data.write_commit.PlannedArray`), the latitude
    and longitude :class:`AxisSplit` s' extents, and the encoded global latitude and longitude; raise ValueError
    (alike on every rank: it reads only what every rank has)."""
    lat, lon, append_dim = settings.lat, settings.lon, settings.append_dim
    lat_tiles = tile_coordinates([g[0] for g in gathered], grid, 0, lat)
    lon_tiles = tile_coordinates([g[1] for g in gathered], grid, 1, lon)
    extents = {lat: place_tiles(lat_tiles, lat, "tile row"), lon: place_tiles(lon_tiles, lon, "tile column")}
    _check_shared(gathered, grid, 0)
    _check_shared(gathered, grid, 1)
    state = local.state
    coordinates = {}
    for name, tiles in ((lat, lat_tiles), (lon, lon_tiles)):  # the whole coordinate, encoded as each tile's
        variable = local.coordinates[name]
        whole = xr.Variable(variable.dims, np.concatenate(tiles), variable.attrs, variable.encoding)
        coordinates[name] = _encode(whole, name, settings, state)[0]
    shapes = {name: tuple(sum(extents[d]) if d in extents else n for d, n in zip(dims, shape))
              for name, (dims, _, shape, *_) in local.variables.items()}
    if local.store is not None and state is None and set(local.store.leftover) != set(local.variables):
        raise ValueError(f"write_tile: path {settings.store_name!r} holds the Zarr arrays "
                         f"{list(local.store.leftover)} but no group zarr.json: a new store whose first write_tile "
                         f"was killed before its commit, of other variables than the tiles' {sorted(local.variables)}; "
                         "remove that folder (e.g. shutil.rmtree) or write to a new path")
    if state is not None:
        _check_store(local, settings, coordinates[lat], coordinates[lon], shapes)
    if append_dim is not None:
        _check_appended(local, settings)
    chunks = dict(settings.chunks)
    arrays = []
    for name, (dims, dtype, _, attrs, fill_value, encoded) in sorted(local.variables.items()):
        shape, start = shapes[name], 0
        if state is not None:
            stored = state[name]
            start = stored["committed"][dims.index(append_dim)] if append_dim in dims else 0
            shape = tuple(s + (n if d == append_dim else 0) for d, s, n in zip(dims, stored["committed"], shape))
            chunking = stored["chunks"]
        elif dims == (name,):  # an index coordinate: one chunk, but along append_dim
            whole = encoded[0] if encoded else max(shape[0], 1)
            chunking = (chunks.get(name, encoded[0] if encoded else 1),) if name == append_dim else (whole,)
        else:  # chunks=, else the variable's encoding, else chunks ~ tiles, append_dim's of 1, other dims whole
            default = {lat: max(extents[lat]), lon: max(extents[lon]), append_dim: 1}
            chunking = tuple(chunks.get(d, encoded[k] if encoded else default.get(d, max(n, 1)))
                             for k, (d, n) in enumerate(zip(dims, shape)))
        index = dims == (name,)
        write = name not in (lat, lon) and (state is None or not index or name == append_dim)
        arrays.append(PlannedArray(name, dims, dtype, shape, tuple(int(c) for c in chunking), attrs, fill_value,
                                   start, write))
    return arrays, extents[lat], extents[lon], coordinates


def _cut(dims, lat, lon, rows, columns, row_origin, column_origin):
    """The index of global ``rows`` x ``columns`` in an array of ``dims`` whose rows start at the origins."""
    index = []
    for d in dims:
        if d == lat:
            index.append(slice(rows.start - row_origin, rows.stop - row_origin))
        elif d == lon:
            index.append(slice(columns.start - column_origin, columns.stop - column_origin))
        else:
            index.append(slice(None))
    return tuple(index)


def _pieces(buffer):
    """``buffer``'s bytes in messages of at most :data:`_PIECE` bytes (at least one, maybe empty)."""
    flat = buffer.reshape(-1).view(np.uint8)
    return [flat[k:k + _PIECE] for k in range(0, max(flat.size, 1), _PIECE)]


def _write_array(array, values, settings, axes, grid, coords, comm, writer):
    """Move ``array``'s rows to the writers of their chunks and write this rank's chunks through ``writer`` (a
    zarr Array, None after an error: the rows still move); return a write error."""
    MPI = mpi() if comm is not None else None
    lat, lon = settings.lat, settings.lon
    rows, columns = axes[0].written(coords[0]), axes[1].written(coords[1])
    held_rows, held_columns = axes[0].held(coords[0]).start, axes[1].held(coords[1]).start
    sends, receives = block_moves(axes, grid, coords)
    owned = None
    if receives == [(tuple(coords), rows, columns)]:  # this rank's chunks are all in its tile: write a view of it
        owned = values[_cut(array.dims, lat, lon, rows, columns, held_rows, held_columns)]
        receives = []
    elif rows and columns:
        shape = tuple(len(rows) if d == lat else len(columns) if d == lon else n
                      for d, n in zip(array.dims, values.shape))
        owned = np.empty(shape, values.dtype)
    me = coords[0] * grid[1] + coords[1]
    requests, arrived = [], []
    for peer, block_rows, block_columns in receives:
        into = _cut(array.dims, lat, lon, block_rows, block_columns, rows.start, columns.start)
        if peer == tuple(coords):
            owned[into] = values[_cut(array.dims, lat, lon, block_rows, block_columns, held_rows, held_columns)]
            continue
        buffer = np.empty(owned[into].shape, values.dtype)
        source = peer[0] * grid[1] + peer[1]
        requests += [comm.Irecv([piece, MPI.BYTE], source=source, tag=_TAG) for piece in _pieces(buffer)]
        arrived.append((into, buffer))
    for peer, block_rows, block_columns in sends:
        destination = peer[0] * grid[1] + peer[1]
        if destination == me:
            continue
        buffer = np.ascontiguousarray(values[_cut(array.dims, lat, lon, block_rows, block_columns, held_rows,
                                                   held_columns)])
        requests += [comm.Isend([piece, MPI.BYTE], dest=destination, tag=_TAG) for piece in _pieces(buffer)]
    if requests:
        wait_all(requests, comm=comm, call="write_tile")
    for into, buffer in arrived:
        owned[into] = buffer
    if owned is None or writer is None:
        return None
    region = []
    for d in array.dims:
        if d == lat:
            region.append(slice(rows.start, rows.stop))
        elif d == lon:
            region.append(slice(columns.start, columns.stop))
        elif d == settings.append_dim:
            region.append(slice(array.start, array.start + owned.shape[array.dims.index(d)]))
        else:
            region.append(slice(None))
    try:
        writer[tuple(region)] = owned
    except Exception as exc:  # reported on every rank at the end: the others still need this rank's rows
        return exc
    return None


def _failed(error, what, settings, new):
    """The error to raise, alike on every rank, where writing (``what``) failed: what the store holds now."""
    if new:
        left = "no store is committed there (no group zarr.json): call write_tile again"
    elif settings.append_dim is None:
        left = ("the store's chunks may be part old, part new (each chunk whole): call write_tile again to overwrite "
                "them all")
    else:
        left = (f"nothing is committed: the store is as it was, holding the {settings.append_dim!r} steps it held "
                "before this call (chunks written beyond them are no part of it); fix the cause and call write_tile "
                "again")
    return RuntimeError(f"write_tile: {what} at {settings.store_name!r} failed: {type(error).__name__}: {error}; "
                        f"{left}")


def write_tile(tile, path, manager=None, *, lat="latitude", lon="longitude", append_dim=None, chunks=None):
    """Write this rank's ``tile`` into the Zarr store at ``path``, with the other ranks' tiles: the whole field.

    Collective over the manager's domain group: call on every rank of the
    group with its own tile and the same other arguments. ``tile`` is an
    ``xarray.Dataset`` holding this rank's tile without halos, with its own
    ``lat`` and ``lon`` coordinates (as ``select_tile(ds, manager, halo=0)``
    gives it, or built by hand: latitude slabs of a ``shard_dim=-2`` manager,
    ``(D_lat, D_lon)`` tiles of a ``shard_dim=(-2, -1)`` one, cut as
    :func:`mpidomain.balanced_split` cuts rows). Every rank returns None once
    every chunk is written. With no manager in a one-process job, the tile is
    the whole field.

    A new store gets every variable and coordinate of the tiles, encoded as
    xarray's writer encodes them (each variable's ``.encoding``: dtype,
    scale_factor, add_offset, _FillValue, time units and calendar, chunks),
    the global ``lat`` and ``lon`` from the ranks' coordinates (gathered,
    checked), and ``chunks`` (``{dim: size}``); by default each latitude and
    longitude chunk is as large as the largest tile along it, other dims one
    chunk, and ``append_dim`` chunks of 1; 1-d index coordinates are one chunk
    (but along ``append_dim``). ``path`` is new, an empty folder or a store;
    an existing store keeps its chunks and encoding. With ``append_dim`` (e.g.
    ``"time"``) the tiles' steps go after the store's, that coordinate too
    (its values strictly increasing, after the store's last); without it the
    tiles overwrite the store (its coordinates must equal the tiles'). Each
    chunk is written whole by one rank, the one holding its first row and
    column; the ranks holding its other rows send them there over the
    library's domain communicator first, so chunks that straddle tiles lose
    no write and the store's bytes are those one process would write. A rank
    holds its tile and the chunks it writes: chunks no larger than tiles keep
    that near ``1/D`` of the field.

    Before any byte is written, every rank of the group raises the same
    ValueError (TypeError for a wrong type) and leaves an existing store as it
    was, byte for byte, for: a folder that is not a Zarr store, tiles that
    overlap, run out of order or leave a hole (each rank's coordinates,
    gathered, run strictly monotonic across the tiles in the manager's order;
    the tiles of a row share latitudes, of a column longitudes; on a regular
    grid a step between two tiles other than the spacing inside them is a
    hole), tiles with halos, extents other than the manager's layout,
    coordinates or variables other than the existing store's, variables,
    dims, dtypes or arguments that differ between ranks, chunks that name no
    dim of the tile, are below 1, or differ from the existing store's, and
    appended steps that repeat or are not after the store's.

    The store changes only at the end, once every rank has written: domain
    rank 0 commits the arrays' new shapes, the ``append_dim`` coordinate's
    last, then the store's consolidated metadata (where it has some), or a
    new store's group ``zarr.json``. A write that fails on any rank raises
    RuntimeError on every rank and commits nothing; after a kill the store
    holds the steps its ``append_dim`` coordinate holds, each whole, and the
    next call writes over what the killed one left (the table in
    docs/data.md, "What a crash leaves"). An overwrite without
    ``append_dim`` rewrites chunks in place: a kill leaves each chunk old or
    new.

    With data-parallel groups (``data_parallel_size > 1``) each domain group
    writes its own samples: give each group its own store, e.g.
    ``f"out_{manager.dp_rank}.zarr"`` (every rank of a domain group has the
    same ``dp_rank``); two groups must never write one store.

    :param tile: This rank's tile, an ``xarray.Dataset`` without halos.
    :param path: The store: a path (new, an empty folder or a Zarr v3 store's), or a zarr Store (e.g. a
        :class:`~mpidomain.data.CountingStore`).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param lat: The latitude dim's name.
    :param lon: The longitude dim's name.
    :param append_dim: Grow the store along this dim (None: overwrite it).
    :param chunks: A new store's chunk sizes, ``{dim: size}``.
    """
    manager = require_manager(manager, "write_tile", alone_ok=True)
    comm = None if manager is None else library_comm(manager)
    grid, coords = ((1, 1), (0, 0)) if manager is None else (
        (tuple(manager.domain_shape) + (1,))[:2], (tuple(manager.domain_coords) + (0,))[:2])
    error = settings = local = None
    try:
        if manager is not None and manager.shard_dims not in ((-2,), (-2, -1)):
            raise ValueError(f"write_tile writes latitude slabs (shard_dim=-2) or latitude x longitude tiles "
                             f"(shard_dim=(-2, -1)), but the manager shards dims {manager.shard_dims}; build the "
                             "manager with shard_dim=-2 or (-2, -1)")
        settings = _settings(tile, path, lat, lon, append_dim, chunks)
        local = _local(tile, settings)
    except Exception as exc:  # every local failure becomes the same error on every rank
        error = exc
    if comm is not None:
        agree(comm, "write_tile", None if local is None else local.description, error=error, mismatch=_mismatch)
        gathered = comm.allgather(local.placement)
    elif error is not None:
        raise error
    else:
        gathered = [local.placement]
    arrays, lat_counts, lon_counts, coordinates = _plan(local, gathered, settings, grid)
    new = local.state is None
    if coords == (0, 0) and local.store is not None and local.store.uncommitted:
        listing = ", ".join(f"{name!r} {n} along {dim!r} (committed {c})" for name, dim, n, c in
                            local.store.uncommitted)
        warnings.warn(f"write_tile: the store at {settings.store_name!r} holds steps a killed write_tile never "
                      f"committed: {listing}; this call writes over them", RuntimeWarning, stacklevel=2)
    error = None
    if new:  # domain rank 0 creates the arrays, before any rank writes into them
        if coords == (0, 0):
            try:
                create_arrays(settings.store, settings.root, arrays, coordinates)
            except Exception as exc:
                error = _failed(exc, "creating the store's arrays", settings, new)
        if comm is not None:
            agree(comm, "write_tile", None, error=error)
        elif error is not None:
            raise error
    writers = {}
    try:
        writers = open_writers(settings.store, arrays, local.store)
    except Exception as exc:
        error = _failed(exc, "opening the store's arrays", settings, new)
    for array in arrays:
        if not array.write:
            continue
        axes = tuple(AxisSplit(counts, array.chunks[array.dims.index(dim)]) if dim in array.dims else
                     absent_axis(parts) for dim, counts, parts in ((lat, lat_counts, grid[0]),
                                                                   (lon, lon_counts, grid[1])))
        failed = _write_array(array, local.values[array.name], settings, axes, grid, coords, comm,
                              None if error is not None else writers[array.name])
        if failed is not None and error is None:
            error = _failed(failed, f"writing this rank's chunks of {array.name!r}", settings, new)
    if comm is not None:
        agree(comm, "write_tile", None, error=error)
    elif error is not None:
        raise error
    if coords == (0, 0):  # every rank has written: make it visible
        try:
            commit(settings.store, arrays, local.store, local.group_attrs, settings.append_dim)
        except Exception as exc:
            left = ("no store is committed (no group zarr.json)" if new else
                    "its arrays may disagree on their lengths until the next write_tile, which takes those of their "
                    "coordinates and writes over the rest")
            error = RuntimeError(f"write_tile: committing the store at {settings.store_name!r} failed: "
                                 f"{type(exc).__name__}: {exc}; every chunk was written, but {left}: fix the cause "
                                 "and call write_tile again")
    if comm is not None:
        agree(comm, "write_tile", None, error=error)
    elif error is not None:
        raise error

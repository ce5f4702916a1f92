"""How a ``write_tile`` call becomes visible: what a store has committed, and the commit that ends each call.

A store holds the steps its ``append_dim`` coordinate holds. A call writes
every chunk first, where no reader looks (beyond the arrays' shapes: zarr
reads no chunk outside an array's shape; a chunk that also holds committed
steps is rewritten whole, and zarr's ``LocalStore`` writes every file to a
temporary name and renames it into place, zarr >= 3.1.3, so a file is old or
new, never torn). Only once every rank has written does domain rank 0
commit, one metadata file at a time: each other array's new shape, then the
``append_dim`` coordinate's, last; then the store's consolidated metadata,
where it has some. A new store is committed by its group's ``zarr.json``,
written after all of its arrays and chunks.

So a killed call leaves one of: the store as it was (plus chunks no reader
sees); arrays longer along a dim than its coordinate (killed inside the
commit: :func:`committed_extent` says what is committed, and the next call
writes over the rest); consolidated metadata a step behind the arrays' own;
or, for a new store, arrays without the group's ``zarr.json`` (no store yet).
:func:`read_store` reads the committed state and each of these leftovers.
"""

import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Tuple

import zarr
from zarr.storage import WrapperStore

__all__ = ["PlannedArray", "StoreState", "commit", "committed_extent", "create_arrays", "open_writers", "read_store"]


@dataclass(frozen=True)
class PlannedArray:
    """One array of the store as a call writes it; alike on every rank.

    ``shape`` is the whole array's after the call, ``start`` where the call's
    values begin along ``append_dim`` (0 if the array lacks it), ``write``
    whether the call writes its chunks.
    """

    name: str
    dims: Tuple[str, ...]
    dtype: str
    shape: Tuple[int, ...]
    chunks: Tuple[int, ...]
    attrs: Any
    fill_value: Any
    start: int
    write: bool


@dataclass(frozen=True)
class StoreState:
    """What an existing store holds, read from each array's own metadata (never from consolidated metadata).

    ``arrays``: ``{name: dict(dims, shape, committed, chunks, dtype, attrs,
    values)}`` (``shape`` as stored, ``committed`` its shape cut to each dim's
    committed extent, ``values`` those of a 1-d index coordinate but
    ``append_dim``'s); None for a new store a killed call left uncommitted,
    whose arrays ``leftover`` names. ``uncommitted``: ``(array, dim, stored,
    committed)`` for each array longer than what is committed. ``last``: the
    stored (encoded) last committed value of ``append_dim``'s coordinate.
    """

    arrays: Any
    consolidated: bool = False
    stale: bool = False
    leftover: Tuple[str, ...] = ()
    uncommitted: Tuple[Tuple[str, str, int, int], ...] = ()
    last: Any = None
    opened: Any = None  # {name: zarr.Array} as read (writable), for open_writers and commit: no second read

    def summary(self):
        """What the ranks of a group must read alike (compared by the agreement)."""
        arrays = None if self.arrays is None else {
            name: (a["dims"], a["shape"], a["committed"], a["chunks"], a["dtype"], repr(a["attrs"]),
                   None if a["values"] is None else a["values"].tobytes()) for name, a in sorted(self.arrays.items())}
        return repr((arrays, self.consolidated, self.stale, self.leftover, self.uncommitted, repr(self.last)))


def committed_extent(dim, lengths, coordinate, where):
    """Return the committed length of ``dim``, given each array's length along it: ``{array: length}``.

    The commit writes ``dim``'s 1-d coordinate (``coordinate``, None if the
    store has none) after every other array: its length is the committed
    one, and longer arrays hold steps a killed call never committed. Without
    a coordinate, the shortest array's. Raise ValueError for an array shorter
    than the coordinate: no ``write_tile`` leaves that. Pure.
    """
    if coordinate is None:
        return min(lengths.values())
    extent = lengths[coordinate]
    shorter = {name: n for name, n in sorted(lengths.items()) if n < extent}
    if shorter:
        listing = ", ".join(f"{name}: {n}" for name, n in sorted(lengths.items()))
        raise ValueError(f"write_tile: the store at {where!r} holds arrays shorter along {dim!r} than its coordinate "
                         f"{coordinate!r} ({listing}; shorter: {sorted(shorter)}): write_tile commits the coordinate "
                         "after every other array, so no write_tile left this store so; restore it, or write to a "
                         "new path")
    return extent


def _local_entries(root):
    """For a folder without a group's ``zarr.json``: ``(arrays, others)``, the entries that are Zarr arrays (a
    ``zarr.json`` of an array inside) and the others (but zarr's temporary ``*.partial`` files)."""
    arrays, others = [], []
    for entry in sorted(os.listdir(root)):
        inside = os.path.join(root, entry, "zarr.json")
        if os.path.isfile(inside):
            try:
                with open(inside, encoding="utf-8") as handle:
                    if json.load(handle).get("node_type") == "array":
                        arrays.append(entry)
                        continue
            except (OSError, ValueError):
                pass
        if not entry.endswith(".partial"):
            others.append(entry)
    return arrays, others


def read_store(store, root, append_dim, where):
    """Return the :class:`StoreState` of the store (None where there is none yet: no path, an empty folder or
    group); raise ValueError for a folder that is not a Zarr store, a Zarr v2 store, arrays without dimension
    names or lengths no ``write_tile`` leaves.

    ``root`` is the store's local folder (None for other stores); ``where``
    names the store in messages. Reads each array's metadata, the values of
    1-d index coordinates but ``append_dim``'s, and of that one the last
    committed value only.
    """
    if root is not None:
        if os.path.exists(root) and not os.path.isdir(root):
            raise ValueError(f"write_tile: path {where!r} is a file, not a Zarr store's folder; pass the path of a "
                             "store, of an empty folder, or a new path")
        if os.path.isdir(root) and not any(os.path.exists(os.path.join(root, name)) for name in
                                           ("zarr.json", ".zgroup", ".zarray")):  # not even a Zarr v2 store
            arrays, others = _local_entries(root)
            if others:
                shown = ", ".join(repr(e) for e in others[:5]) + (", ..." if len(others) > 5 else "")
                raise ValueError(f"write_tile: path {where!r} is an existing folder that is not a Zarr store (it "
                                 f"holds {shown} and no zarr.json): write_tile would write its files among them; "
                                 "pass a new path, an empty folder, or a store's")
            return StoreState(None, leftover=tuple(arrays)) if arrays else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zarr: consolidated metadata is not part of the v3 specification
            group = zarr.open_group(store, mode="r+")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError):
        return None
    consolidated = group.metadata.consolidated_metadata
    if consolidated is not None:  # read each array's own metadata, not the consolidated copy
        group = zarr.open_group(store, mode="r+", use_consolidated=False)
    if group.metadata.zarr_format != 3:
        raise ValueError(f"write_tile: path holds a Zarr v{group.metadata.zarr_format} store; write_tile adds to "
                         "Zarr v3 stores only: write to a new path (it makes a v3 store)")
    opened = dict(group.arrays())
    if not opened:
        return None
    arrays = {}
    for name, array in opened.items():
        dims = array.metadata.dimension_names
        if dims is None:
            raise ValueError(f"write_tile: the store's array {name!r} has no dimension names (written neither by "
                             "xarray nor by write_tile); write to a new path")
        arrays[name] = {"dims": tuple(dims), "shape": tuple(array.shape), "chunks": tuple(array.chunks),
                        "dtype": str(array.dtype), "attrs": dict(array.attrs)}
    extents = {}
    for dim in sorted({d for a in arrays.values() for d in a["dims"]}):
        lengths = {name: a["shape"][a["dims"].index(dim)] for name, a in arrays.items() if dim in a["dims"]}
        coordinate = dim if dim in arrays and arrays[dim]["dims"] == (dim,) else None
        extents[dim] = committed_extent(dim, lengths, coordinate, where)
    uncommitted = []
    for name, a in sorted(arrays.items()):
        a["committed"] = tuple(extents[d] for d in a["dims"])
        uncommitted += [(name, d, n, extents[d]) for d, n in zip(a["dims"], a["shape"]) if n != extents[d]]
        a["values"] = opened[name][...] if a["dims"] == (name,) and name != append_dim else None
    last = None
    if append_dim in arrays and arrays[append_dim]["dims"] == (append_dim,) and extents[append_dim] > 0:
        last = opened[append_dim][extents[append_dim] - 1]
    stale = consolidated is not None and (
        set(consolidated.metadata) != set(arrays) or
        any(tuple(consolidated.metadata[n].shape) != a["shape"] for n, a in arrays.items()))
    return StoreState(arrays, consolidated is not None, stale, (), tuple(uncommitted), last, opened)


class _RootLast(WrapperStore):
    """The store, without the group ``zarr.json`` zarr writes when it creates an array: :func:`commit` writes it."""

    async def set_if_not_exists(self, key, value):
        if key != "zarr.json":
            await self._store.set_if_not_exists(key, value)


def create_arrays(store, root, arrays, values):
    """Create a new store's arrays (metadata only, over any a killed call left) and write ``values``
    (``{name: values}``, the latitude and longitude); the group's ``zarr.json`` is left to :func:`commit`.

    Run by one rank. An existing group without arrays loses its ``zarr.json``
    here where the store is a local folder (elsewhere it stays, and the
    arrays are visible as they are made).
    """
    if root is not None and os.path.isfile(os.path.join(root, "zarr.json")):
        os.remove(os.path.join(root, "zarr.json"))
    target = _RootLast(store if isinstance(store, zarr.abc.store.Store) else zarr.storage.LocalStore(store))
    for array in arrays:
        created = zarr.create_array(target, name=array.name, shape=array.shape, chunks=array.chunks,
                                    dtype=array.dtype, dimension_names=array.dims, fill_value=array.fill_value,
                                    attributes=array.attrs, overwrite=True)
        if array.name in values:
            created[...] = values[array.name]


def open_writers(store, arrays, state):
    """Return ``{name: zarr.Array}`` to write the chunks of each array the call writes, with its shape after the
    call: where that is longer than the stored one, a view whose grown shape is never saved (the commit saves
    it). ``state``: the store's :class:`StoreState` (its arrays as read), None for a new store."""
    writers = {}
    opened = {} if state is None or state.opened is None else state.opened
    for array in arrays:
        if not array.write:
            continue
        stored = opened.get(array.name) or zarr.open_array(store, path=array.name, mode="r+")
        if tuple(stored.shape) != array.shape:
            grown = zarr.AsyncArray(metadata=stored.metadata.update_shape(array.shape), store_path=stored.store_path,
                                    config=stored.async_array.config)
            stored = zarr.Array(grown)
        writers[array.name] = stored
    return writers


def commit(store, arrays, state, group_attrs, append_dim):
    """Make the call's writes visible; run by one rank once every rank has written.

    A new store (``state`` None, or one a killed call left): its group's
    ``zarr.json``. Otherwise each array whose shape changes, one metadata
    file each: every other array first, the 1-d coordinates after them, and
    ``append_dim``'s last; then the consolidated metadata, where the store
    has some and it changed or lagged.
    """
    if state is None or state.arrays is None:
        zarr.open_group(store, mode="a", zarr_format=3, attributes=group_attrs)
        return
    changed = [a for a in arrays if a.shape != state.arrays[a.name]["shape"]]
    order = sorted(changed, key=lambda a: (a.name == append_dim, a.dims == (a.name,), a.name))
    for array in order:
        state.opened[array.name].resize(array.shape)
    if state.consolidated and (order or state.stale):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # zarr: consolidated metadata is not part of the v3 specification
            zarr.consolidate_metadata(store)

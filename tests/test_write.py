"""mpidomain.data.write_tile: tiles written together make the store one process writes, chunk file for chunk file.

Every rank of the world cuts its tile of a small dataset (two variables with
time, one with levels, a static one; a datetime time coordinate; attributes)
with select_tile and writes it with write_tile into a store in rank 0's
temporary directory, on every layout of the world's ranks (latitude slabs,
tiles; uneven splits), with the default chunks and with chunks that straddle
tiles. Rank 0 compares the store with xarray's ``to_zarr`` of the whole
dataset (same chunks): every file, metadata and chunks, byte for byte, and the
dataset it opens to. Appends (also to a store xarray wrote with its defaults,
consolidated metadata included), encodings (packed ints, fill values, time
units, chunks) against xarray's own files, the bytes each rank writes (exact
counts against the chunks each rank is the writer of), every mistake (the same
error on every rank, the existing store unchanged: a folder that is no store,
steps appended twice or out of order among them) and one store per
data-parallel group. Failures and kills: tests/test_write_faults.py.
"""

import bisect
import hashlib
import json
import os
import warnings

import numpy as np
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

from mpidomain import DomainParallelManager, balanced_split, get_domain_parallel_manager  # noqa: E402
from mpidomain.data import CountingStore, select_tile, write_tile  # noqa: E402

GRIDS = [(13, 24), (16, 32)]  # uneven and even over 2 and 4 ranks
LEVELS = (500, 850)
STRADDLING = {"latitude": 5, "longitude": 7}  # chunks that cut across the tiles of every layout of 2 and 4 ranks


def make_dataset(shape=GRIDS[0], steps=3, seed=0, first_step=0):
    """A small ERA5-like dataset: ``t`` (time, level, lat, lon) float32, ``sp`` (time, lat, lon) float64, ``land``
    (lat, lon) int16; 6-hourly datetime64 times; attributes on variables, coordinates and the dataset."""
    H, W = shape
    rng = np.random.default_rng(seed)
    times = np.datetime64("2000-01-01T00", "ns") + (first_step + np.arange(steps)) * np.timedelta64(6, "h")
    return xr.Dataset(
        {"t": (("time", "level", "latitude", "longitude"),
               rng.standard_normal((steps, len(LEVELS), H, W)).astype(np.float32), {"units": "K"}),
         "sp": (("time", "latitude", "longitude"), rng.standard_normal((steps, H, W)), {"long_name": "pressure"}),
         "land": (("latitude", "longitude"), rng.integers(0, 3, (H, W)).astype(np.int16))},
        coords={"time": times, "level": ("level", list(LEVELS), {"units": "hPa"}),
                "latitude": ("latitude", np.linspace(90, -90, H), {"units": "degrees_north"}),
                "longitude": np.arange(W) * 360.0 / W},
        attrs={"title": "write_tile test"})


@pytest.fixture(scope="module")
def layouts():
    """Every layout the world's ranks test: latitude slabs, and tiles (1 x 2 at 2 ranks, 2 x 2 at 4)."""
    world = MPI.COMM_WORLD
    built = [("slabs", DomainParallelManager(world.size, world.size))]
    tiles = {2: (1, 2), 4: (2, 2)}.get(world.size)
    if tiles:
        built.append((f"{tiles[0]}x{tiles[1]}", DomainParallelManager(world.size, tiles, (-2, -1))))
    yield built
    for _, manager in built:
        manager.close()


@pytest.fixture
def shared(world, tmp_path):
    """A directory every rank writes into: rank 0's temporary directory."""
    return world.bcast(str(tmp_path) if world.rank == 0 else None)


def tile_of(data, manager):
    """This rank's tile of ``data``, loaded, as select_tile cuts it."""
    return select_tile(data, manager).load()


def grid_of(manager):
    """``(D_lat, D_lon)`` of a manager."""
    return (tuple(manager.domain_shape) + (1,))[:2]


def default_chunks(manager, shape):
    """write_tile's default chunks of a new store on ``manager``'s layout: the largest tile along each dim."""
    return {"latitude": balanced_split(shape[0], grid_of(manager)[0])[0][0],
            "longitude": balanced_split(shape[1], grid_of(manager)[1])[0][0]}


def write_reference(data, path, chunks, append):
    """``data`` written by xarray in one piece, with write_tile's chunks (time steps of 1 when it appends)."""
    step = {"time": 1} if append else {"time": data.sizes["time"]}
    sizes = dict(data.sizes) | step | chunks
    encoding = {name: {"chunks": tuple(sizes[d] for d in data[name].dims)} for name in data.data_vars}
    if append:
        encoding["time"] = {"chunks": (1,)}
    data.to_zarr(path, encoding=encoding, consolidated=False, zarr_format=3)


def files_of(path):
    """Every file of a store: {path in the store: bytes}."""
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as handle:
                found[os.path.relpath(os.path.join(root, name), path)] = handle.read()
    return found


def digest_of(path):
    """One digest of every file's name and bytes under ``path``."""
    hashed = hashlib.sha256()
    for name, content in sorted(files_of(path).items()):
        hashed.update(name.encode() + b"\0" + content)
    return hashed.hexdigest()


def differences(path, reference):
    """How the store at ``path`` differs from the one at ``reference``: files, then the datasets they open to."""
    mine, theirs = files_of(path), files_of(reference)
    problems = [f"only in one store: {sorted(set(mine) ^ set(theirs))}"] if set(mine) != set(theirs) else []
    for name in sorted(set(mine) & set(theirs)):
        if name.endswith("zarr.json"):
            if json.loads(mine[name]) != json.loads(theirs[name]):
                problems.append(f"{name} differs: {json.loads(mine[name])} vs {json.loads(theirs[name])}")
        elif mine[name] != theirs[name]:
            problems.append(f"chunk file {name} differs")
    got, want = (xr.open_zarr(p, consolidated=False).load() for p in (path, reference))
    try:
        xr.testing.assert_identical(got, want)
    except AssertionError as error:
        problems.append(f"the datasets differ: {error}")
    for name in want.variables:
        if name in got.variables and (got[name].dtype != want[name].dtype
                                      or not np.array_equal(got[name].values, want[name].values,
                                                            equal_nan=want[name].dtype.kind in "fc")):
            problems.append(f"{name}: {got[name].dtype} vs {want[name].dtype}, or other values")
    return problems


@pytest.mark.parametrize("shape", GRIDS)
@pytest.mark.parametrize("chunking", ["default", "straddling"])
def test_tiles_write_the_store_one_process_writes(world, layouts, shared, shape, chunking):
    """On every layout, the tiles' store equals xarray's of the whole field, every file byte for byte."""
    data = make_dataset(shape)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-{chunking}.zarr")
        write_tile(tile_of(data, manager), path, manager, chunks=STRADDLING if chunking == "straddling" else None)
        if world.rank == 0:
            reference = os.path.join(shared, f"{label}-{chunking}-xarray.zarr")
            chunks = STRADDLING if chunking == "straddling" else default_chunks(manager, shape)
            write_reference(data, reference, chunks, append=False)
            problems += [f"{label}: {p}" for p in differences(path, reference)]
    assert not problems, problems


def test_append_over_three_calls(world, layouts, shared):
    """Steps appended in three calls (1, 2, 1 steps) make the store xarray writes of all four at once."""
    data = make_dataset(GRIDS[0], steps=4, seed=1)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-append.zarr")
        for steps in (slice(0, 1), slice(1, 3), slice(3, 4)):
            write_tile(tile_of(data.isel(time=steps), manager), path, manager, append_dim="time", chunks=STRADDLING)
        if world.rank == 0:
            reference = os.path.join(shared, f"{label}-append-xarray.zarr")
            write_reference(data, reference, STRADDLING, append=True)
            problems += [f"{label}: {p}" for p in differences(path, reference)]
    assert not problems, problems


def test_overwrite_rewrites_the_tiles_region(world, layouts, shared):
    """Without append_dim an existing store is overwritten: it then holds the new values only."""
    old, new = make_dataset(GRIDS[1], seed=2), make_dataset(GRIDS[1], seed=3)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-overwrite.zarr")
        write_tile(tile_of(old, manager), path, manager, chunks=STRADDLING)
        write_tile(tile_of(new, manager), path, manager)
        if world.rank == 0:
            reference = os.path.join(shared, f"{label}-overwrite-xarray.zarr")
            write_reference(new, reference, STRADDLING, append=False)
            problems += [f"{label}: {p}" for p in differences(path, reference)]
    assert not problems, problems


def opened(path, consolidated):
    """The dataset at ``path``, loaded: read through its consolidated metadata, or through each array's own."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zarr: consolidated metadata is not in the v3 spec
        return xr.open_zarr(path, consolidated=consolidated).load()


@pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part")  # zarr, of xarray's defaults
def test_append_to_a_store_xarray_wrote_with_its_defaults(world, layouts, shared):
    """A store xarray wrote with its defaults (consolidated metadata, one time chunk of the first steps) grows by
    tiles as xarray's own appends grow it: read with and without the consolidated metadata, the same steps."""
    first, later = make_dataset(GRIDS[0], steps=2, seed=4), make_dataset(GRIDS[0], steps=3, seed=5, first_step=2)
    problems = []
    for label, manager in layouts:
        path, reference = (os.path.join(shared, f"{label}-defaults{end}.zarr") for end in ("", "-xarray"))
        if world.rank == 0:
            first.to_zarr(path)
            first.to_zarr(reference)
        world.Barrier()
        for steps in (slice(0, 1), slice(1, 3)):  # the first fills xarray's time chunk of 2, the second starts two
            write_tile(tile_of(later.isel(time=steps), manager), path, manager, append_dim="time")
            if world.rank == 0:
                later.isel(time=steps).to_zarr(reference, append_dim="time")
        if world.rank == 0:
            whole = xr.concat([first.drop_vars("land"), later.drop_vars("land")], "time")  # land: the last call's
            for consolidated in (True, False):
                got, want = opened(path, consolidated), opened(reference, consolidated)
                if not got.identical(want) or not got.drop_vars("land").identical(whole):
                    problems.append(f"{label}, consolidated={consolidated}: times {got.time.values} (xarray's "
                                    f"{want.time.values}), t equal: {np.array_equal(got.t.values, want.t.values)}")
            problems += [f"{label}: {p}" for p in differences(path, reference)]
    assert not problems, problems


def test_refuses_a_folder_that_is_not_a_store(world, layouts, shared):
    """An existing folder without a store's zarr.json: the same error on every rank, nothing written into it; an empty
    folder is fine."""
    data = make_dataset(GRIDS[0], steps=1)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-user-folder")
        if world.rank == 0:
            os.makedirs(path)
            with open(os.path.join(path, "notes.txt"), "w") as handle:
                handle.write("the user's own file\n")
        world.Barrier()
        before = digest_of(path) if world.rank == 0 else None
        for append_dim in (None, "time"):
            try:
                write_tile(tile_of(data, manager), path, manager, append_dim=append_dim)
                raised = None
            except ValueError as error:
                raised = str(error)
            messages = world.allgather(raised)
            if world.rank == 0:
                if len(set(messages)) != 1 or messages[0] is None or path not in messages[0] \
                        or "not a Zarr store" not in messages[0] or "notes.txt" not in messages[0]:
                    problems.append(f"{label}: expected one error naming {path!r} and notes.txt, got {messages}")
                if digest_of(path) != before or sorted(os.listdir(path)) != ["notes.txt"]:
                    problems.append(f"{label}: the folder changed: {sorted(os.listdir(path))}")
        empty = os.path.join(shared, f"{label}-empty-folder")
        if world.rank == 0:
            os.makedirs(empty)
        world.Barrier()
        write_tile(tile_of(data, manager), empty, manager)
        if world.rank == 0:
            reference = os.path.join(shared, f"{label}-empty-folder-xarray.zarr")
            write_reference(data, reference, default_chunks(manager, GRIDS[0]), append=False)
            problems += [f"{label}, empty folder: {p}" for p in differences(empty, reference)]
    assert not problems, problems


def encoded_dataset(steps, first_step=0):
    """make_dataset with the encodings xarray's writer honours: t packed in int16 (scale_factor, add_offset,
    _FillValue, NaN where it is missing), sp stored as float32 with a _FillValue and its own chunks, times in
    minutes since a date of the encoding's calendar."""
    data = make_dataset(GRIDS[1], steps=steps, seed=6 + first_step, first_step=first_step)
    t = data.t.values.copy()
    t[:, 0, :3, :4] = np.nan
    data = data.assign(t=(data.t.dims, t, data.t.attrs))
    data.t.encoding = {"dtype": "int16", "scale_factor": 0.001, "add_offset": 0.5, "_FillValue": -32767}
    data.sp.encoding = {"dtype": "float32", "_FillValue": -9999.0, "chunks": (1, 5, 7)}
    data.time.encoding = {"units": "minutes since 1999-12-31 00:00:00", "calendar": "proleptic_gregorian"}
    return data


def cut_by_hand(data, manager):
    """This rank's tile of ``data`` cut with isel, which keeps each variable's encoding (as a user's tile may)."""
    cut = {}
    for dim, parts, index in zip(("latitude", "longitude"), grid_of(manager),
                                 (tuple(manager.domain_coords) + (0,))[:2]):
        counts, offsets = balanced_split(data.sizes[dim], parts)
        cut[dim] = slice(offsets[index], offsets[index] + counts[index])
    return data.isel(cut)


def test_encoding_as_xarray_writes_it(world, layouts, shared):
    """A variable's encoding (dtype, scale_factor, add_offset, _FillValue, time units and calendar, chunks) is
    honoured as xarray's writer honours it: every file of the store equals xarray's, for a new store and appends."""
    data, later = encoded_dataset(2), encoded_dataset(2, first_step=2)
    problems = []
    for label, manager in layouts:
        path, reference = (os.path.join(shared, f"{label}-encoded{end}.zarr") for end in ("", "-xarray"))
        write_tile(cut_by_hand(data, manager), path, manager, append_dim="time")
        write_tile(cut_by_hand(later, manager), path, manager, append_dim="time")
        if world.rank == 0:
            chunks = default_chunks(manager, GRIDS[1])
            sizes = dict(data.sizes) | {"time": 1} | chunks  # to_zarr's encoding= replaces a variable's encoding
            encoding = {name: data[name].encoding | {"chunks": tuple(sizes[d] for d in data[name].dims)}
                        for name in ("t", "land")}
            data.to_zarr(reference, encoding=encoding | {"time": data.time.encoding | {"chunks": (1,)}},
                         consolidated=False)
            later.to_zarr(reference, append_dim="time", consolidated=False)
            problems += [f"{label}: {p}" for p in differences(path, reference)]
            stored = json.loads(files_of(path)["t/zarr.json"])
            if stored["data_type"] != "int16" or stored["attributes"].get("scale_factor") != 0.001:
                problems.append(f"{label}: t stored as {stored['data_type']} with {stored['attributes']}")
            got = opened(path, False)
            whole = xr.concat([data.drop_vars("land"), later.drop_vars("land")], "time")
            if not np.allclose(got.t.values, whole.t.values, atol=6e-4, equal_nan=True):
                problems.append(f"{label}: t does not decode to the values written (to the packing's step)")
    assert not problems, problems


def writer_of(key, store, grid, shape):
    """The domain rank that writes the file ``key`` of a new store: the tile holding its chunk's first row and column
    (rank 0 for metadata and the coordinates)."""
    parts = key.split("/")
    if parts[-1] == "zarr.json" or parts[0] in ("time", "level", "latitude", "longitude"):
        return 0
    dims = store[parts[0]].metadata.dimension_names
    index = [int(k) for k in parts[2:]]
    chunks = store[parts[0]].chunks
    place = [0, 0]
    for axis, (dim, extent) in enumerate(zip(("latitude", "longitude"), shape)):
        if dim in dims:
            first = index[dims.index(dim)] * chunks[dims.index(dim)]
            offsets = balanced_split(extent, grid[axis])[1]
            place[axis] = bisect.bisect_right(offsets, first) - 1
    return place[0] * grid[1] + place[1]


@pytest.mark.parametrize("chunking", ["default", "straddling"])
def test_each_rank_writes_the_bytes_of_its_chunks(world, layouts, shared, chunking):
    """CountingStore's bytes and keys written, per rank, are exactly those of the chunks whose first row and column
    its tile holds (plus, on rank 0, the metadata and coordinates); with chunks ~ tiles, 1/D of the field each."""
    shape = GRIDS[0]
    data = make_dataset(shape)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-bytes-{chunking}.zarr")
        store = CountingStore(zarr.storage.LocalStore(path))
        write_tile(tile_of(data, manager), store, manager, chunks=STRADDLING if chunking == "straddling" else None)
        counts = world.gather((store.bytes_written, store.writes))
        if world.rank == 0:
            group = zarr.open_group(path, mode="r")
            expected = [[0, 0] for _ in range(world.size)]
            for key, content in files_of(path).items():
                writer = expected[writer_of(key, group, grid_of(manager), shape)]
                writer[0] += len(content)
                writer[1] += 1
            if [list(c) for c in counts] != expected:
                problems.append(f"{label}: (bytes, keys) written per rank {counts}, expected {expected}")
            if chunking == "default":  # chunks as large as the largest tile: each rank writes as many of t's
                writers = [writer_of(k, group, grid_of(manager), shape) for k in files_of(path) if k.startswith("t/c/")]
                if len({writers.count(r) for r in range(world.size)}) != 1:
                    problems.append(f"{label}: ranks write different numbers of t's chunks: "
                                    f"{[writers.count(r) for r in range(world.size)]}")
    assert not problems, problems


def mistakes(manager, data):
    """name: (this rank's tile, write_tile's keywords, the exception, a phrase of its message), for ``manager``'s
    layout; the cases its layout cannot make (one tile along every dim) are left out."""
    grid, coords = grid_of(manager), (tuple(manager.domain_coords) + (0,))[:2]
    tile = tile_of(data, manager)
    last = manager.domain_rank == manager.domain_parallel_size - 1
    cases = {
        "halos": (select_tile(data, manager, halo=1).load(), {}, ValueError, "with halos"),
        "other coordinates": (tile.assign_coords(latitude=tile.latitude + 0.5), {}, ValueError,
                              "differ from the store"),
        "a variable missing": (tile.drop_vars("sp") if last else tile, {}, ValueError, "variables"),
        "another dtype": (tile.assign(t=tile.t.astype(np.float64)) if last else tile, {}, ValueError, "dtype"),
        "chunks of no dim": (tile, {"chunks": {"height": 2}}, ValueError, "'height'"),
        "chunks below 1": (tile, {"chunks": {"latitude": 0}}, ValueError, "must be >= 1"),
        "chunks not the store's": (tile, {"chunks": {"latitude": 2}}, ValueError, "a store keeps its chunks"),
        "finer times": (tile.assign_coords(time=tile.time + np.timedelta64(1, "m")), {}, ValueError,
                        "cannot be stored exactly"),
        "not a dataset": (tile["t"], {}, TypeError, "must be an xarray.Dataset"),
        "a time the store holds": (tile.assign_coords(time=tile.time - 2 * np.timedelta64(6, "h")), {}, ValueError,
                                   "2000-01-01T12:00"),
        "an earlier time": (tile.assign_coords(time=tile.time - 4 * np.timedelta64(6, "h")), {}, ValueError,
                            "not after"),
        "a repeated time": (tile.assign_coords(time=[tile.time.values[0]] * 2), {}, ValueError,
                            "strictly increasing"),
        "times out of order": (tile.assign_coords(time=tile.time.values[::-1]), {}, ValueError,
                               "strictly increasing"),
    }
    if manager.domain_parallel_size > 1:
        cases["chunks differ between ranks"] = (tile, {"chunks": {"latitude": 3 + manager.domain_rank}}, ValueError,
                                                "the arguments differ")
    split = next((axis for axis in (0, 1) if grid[axis] > 1), None)
    if split is not None:  # cut this rank's rows by hand along a split dim, wrongly
        dim, extent = ("latitude", "longitude")[split], data.sizes[("latitude", "longitude")[split]]
        counts, offsets = balanced_split(extent, grid[split])
        start, stop = offsets[coords[split]], offsets[coords[split]] + counts[coords[split]]
        other_dim = ("latitude", "longitude")[1 - split]  # this rank's columns (rows) along the other dim, as cut
        other_counts, other_offsets = balanced_split(data.sizes[other_dim], grid[1 - split])
        at = coords[1 - split]
        across = slice(other_offsets[at], other_offsets[at] + other_counts[at])
        wrong = {
            "overlap": (max(0, start - 1), stop, "overlap"),  # one row of the tile before: a halo
            "hole": (start + (coords[split] > 0), stop, "a hole"),  # the first row of every later tile lost
            "uneven": (start + (coords[split] > 0), stop + (coords[split] < grid[split] - 1), "balanced_split"),
        }
        for name, (first, end, phrase) in wrong.items():
            piece = data.isel({dim: slice(first, end), other_dim: across}).load()
            cases[name] = (piece, {}, ValueError, phrase)
    return cases


def test_mistakes_raise_alike_and_leave_the_store_as_it_was(world, layouts, shared):
    """Every mistake raises the same error on every rank of the domain group, and no byte of the store changes."""
    data, later = make_dataset(GRIDS[0]), make_dataset(GRIDS[0], steps=2, first_step=3)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-mistakes.zarr")
        write_tile(tile_of(data, manager), path, manager, append_dim="time")
        before = digest_of(path) if world.rank == 0 else None
        for name, (tile, keywords, kind, phrase) in mistakes(manager, later).items():
            try:
                write_tile(tile, path, manager, append_dim="time", **keywords)
                raised = None
            except (TypeError, ValueError) as error:
                raised = error
            messages = world.allgather(None if raised is None else (type(raised).__name__, str(raised)))
            if world.rank == 0:
                if len(set(messages)) != 1 or messages[0] is None:
                    problems.append(f"{label} {name}: not the same error on every rank: {messages}")
                elif messages[0][0] != kind.__name__ or phrase not in messages[0][1]:
                    problems.append(f"{label} {name}: expected {kind.__name__} saying {phrase!r}, got {messages[0]}")
                elif "write_tile" not in messages[0][1]:
                    problems.append(f"{label} {name}: the message does not name write_tile: {messages[0]}")
                if digest_of(path) != before:
                    problems.append(f"{label} {name}: the store changed")
    assert not problems, problems


def test_each_data_parallel_group_writes_its_own_store(world, shared):
    """Two domain groups (where the world's ranks make two), each writing its own sample to its own store."""
    domain = world.size // 2 if world.size > 1 else 1
    problems = []
    with DomainParallelManager(world.size, domain) as manager:
        sample = make_dataset(GRIDS[0], seed=10 + manager.dp_rank)
        path = os.path.join(shared, f"group-{manager.dp_rank}.zarr")
        write_tile(tile_of(sample, manager), path, manager, append_dim="time")
        world.Barrier()
        if world.rank == 0:
            for group in range(manager.dp_world_size):
                got = xr.open_zarr(os.path.join(shared, f"group-{group}.zarr"), consolidated=False).load()
                if not got.identical(make_dataset(GRIDS[0], seed=10 + group)):
                    problems.append(f"group {group}'s store differs from its sample")
    assert not problems, problems


def test_without_a_manager(world, shared):
    """Alone, write_tile writes the whole dataset; in a job of several processes it needs a manager, on every rank."""
    if get_domain_parallel_manager() is not None:
        pytest.skip("a global manager is initialised")
    data = make_dataset(GRIDS[1])
    path = os.path.join(shared, "alone.zarr")
    if world.size > 1:
        with pytest.raises(RuntimeError, match="write_tile needs a domain-parallel manager"):
            write_tile(data, path)
        return
    write_tile(data, path, chunks=STRADDLING)
    write_reference(data, os.path.join(shared, "alone-xarray.zarr"), STRADDLING, append=False)
    assert not differences(path, os.path.join(shared, "alone-xarray.zarr"))


def test_counting_store_counts_writes(tmp_path):
    """bytes_written and writes: every file zarr stores through the wrapper, once; reset() zeroes them."""
    store = CountingStore(zarr.storage.LocalStore(tmp_path / "counted.zarr"))
    array = zarr.create_array(store, shape=(6, 4), chunks=(3, 4), dtype="f8", fill_value=np.nan)
    array[...] = np.arange(24.0).reshape(6, 4)
    stored = files_of(tmp_path / "counted.zarr")
    assert (store.bytes_written, store.writes) == (sum(len(v) for v in stored.values()), len(stored))
    store.reset()
    assert (store.bytes_written, store.writes, store.bytes_read, store.reads) == (0, 0, 0, 0)
    array[:3] = 1.0
    assert (store.bytes_written, store.writes) == (len(files_of(tmp_path / "counted.zarr")["c/0/0"]), 1)


def test_each_chunk_has_one_writer_holding_its_first_row():
    """AxisSplit (pure): the rows the tiles write partition the dim in whole chunks, each chunk written by the tile
    holding its first row; block_moves send every held row to its writer once."""
    from mpidomain.data.write_layout import AxisSplit, block_moves

    for extent in range(1, 15):
        for parts in range(1, 5):
            for chunk in range(1, 9):
                split = AxisSplit(balanced_split(extent, parts)[0], chunk)
                rows = [row for i in range(parts) for row in split.written(i)]
                assert rows == list(range(extent)), (extent, parts, chunk)
                for i in range(parts):
                    for start in range(split.written(i).start, split.written(i).stop, chunk):
                        assert start % chunk == 0 and start in split.held(i), (extent, parts, chunk, i)
                whole = AxisSplit((extent,), 1)
                sent = sorted(row for i in range(parts) for _, rows, _ in block_moves((split, whole), (parts, 1),
                                                                                     (i, 0))[0] for row in rows)
                assert sent == list(range(extent)), (extent, parts, chunk)

"""mpidomain.data: each rank's tile read lazily from Zarr and netCDF stores, against the padded global field.

Every rank writes the same small stores in its own temporary directory,
opens them lazily, selects its tile with halos, and compares bit for bit with
the global field padded in one piece (``np.pad`` or the Earth reference of
tests/test_tiles.py) and with ``halo_exchange`` of its halo-free tile, on
every layout of the world's ranks (slabs and tiles, uneven splits). A Zarr
store wrapper counts the bytes each rank reads.
"""

import itertools

import numpy as np
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")
pytest.importorskip("netCDF4")
torch = pytest.importorskip("torch")

from mpidomain import DomainParallelManager, halo_exchange  # noqa: E402
from mpidomain.data import CountingStore, select_tile  # noqa: E402
from test_tiles import BOUNDARIES, global_pad, layouts, window  # noqa: E402

WORLD = MPI.COMM_WORLD
H, W = 13, 18  # uneven over 2 and 4 ranks along both dims
LEVELS = (500, 850)
HALOS = [1, (2, 3)]


def make_dataset():
    rng = np.random.default_rng(7)
    return xr.Dataset(
        {"t": (("time", "level", "latitude", "longitude"), rng.standard_normal((2, len(LEVELS), H, W))),
         "sp": (("time", "latitude", "longitude"), rng.standard_normal((2, H, W)).astype(np.float32)),
         "weight": (("latitude",), np.cos(np.linspace(-1.5, 1.5, H)))},
        coords={"time": np.arange(2), "level": list(LEVELS), "latitude": np.linspace(90, -90, H),
                "longitude": np.arange(W) * 360.0 / W})


def write_zarr(dataset, path, rows):
    """``dataset`` in a Zarr store, uncompressed, chunked by time step, level and bands of ``rows`` latitudes."""
    encoding = {"t": {"chunks": (1, 1, rows, W), "compressors": None},
                "sp": {"chunks": (1, rows, W), "compressors": None}}
    dataset.to_zarr(path, mode="w", encoding=encoding, consolidated=False, zarr_format=3)
    return path


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Paths of the same dataset as Zarr (bands of 2 latitudes) and netCDF, in this rank's own directory."""
    root = tmp_path_factory.mktemp("data")
    dataset = make_dataset()
    dataset.to_netcdf(root / "sample.nc", engine="netcdf4")
    return {"zarr": write_zarr(dataset, root / "sample.zarr", 2), "netcdf": root / "sample.nc"}


def open_store(stores, kind):
    if kind == "zarr":
        return xr.open_zarr(stores[kind], consolidated=False, chunks=None)
    return xr.open_dataset(stores[kind], engine="netcdf4")


@pytest.fixture(scope="module")
def managers():
    """Every layout of the world's ranks: latitude slabs, then each (D_lat, D_lon) grid of tiles."""
    size = WORLD.size
    built = [("slabs", DomainParallelManager(size, size))]
    built += [(grid, DomainParallelManager(size, grid, (-2, -1))) for grid in layouts(size)]
    yield built
    for _, manager in built:
        manager.close()


def pair(halo, manager, boundary):
    """``halo`` as (latitude, longitude) widths, as halo_exchange reads an int."""
    if isinstance(halo, tuple):
        return halo
    slabs = len(manager.domain_shape) == 1
    return (halo, 0) if slabs and boundary != "earth" else (halo, halo)


def problems_of(data, manager, boundary, field_of):
    """Where this rank's selections differ from the global pad and from halo_exchange of its tile."""
    keywords = BOUNDARIES[boundary][0]
    problems = []
    plain = select_tile(data, manager, lat="latitude", lon="longitude")
    for halo in HALOS:
        try:
            padded = select_tile(data, manager, halo=halo, **keywords)
        except ValueError as error:  # a halo wider than this layout's tiles: skipped alike on every rank
            assert "wider than the smallest tile" in str(error), error
            continue
        h = pair(halo, manager, boundary)
        for name in ("t", "sp"):
            field = field_of(name)
            want = global_pad(field, h, boundary)[window(manager, field.shape, h)]
            got = padded[name].values
            exchanged = halo_exchange(np.ascontiguousarray(plain[name].values), h, dim=(-2, -1), **keywords,
                                      manager=manager)
            if got.dtype != field.dtype or not np.array_equal(got, want):
                problems.append(f"{boundary} halo {halo} {name}: rank {manager.rank} differs from the global pad")
            if not np.array_equal(got, exchanged):
                problems.append(f"{boundary} halo {halo} {name}: rank {manager.rank} differs from halo_exchange")
        strided = padded["sp"].isel(time=1, latitude=slice(None, None, 2), longitude=slice(1, None, 3)).values
        if not np.array_equal(strided, global_pad(field_of("sp"), h, boundary)[window(manager, (2, H, W), h)][1, ::2, 1::3]):
            problems.append(f"{boundary} halo {halo}: rank {manager.rank}'s strided part differs from the global pad")
    return problems


@pytest.mark.parametrize("kind, boundary", [("zarr", b) for b in sorted(BOUNDARIES)]
                         + [("netcdf", "earth"), ("netcdf", "zeros")])
def test_select_tile_equals_the_padded_global_field(managers, stores, kind, boundary):
    """Every layout, halo and variable: the selected padded tile is the global pad cut to it, and halo_exchange's."""
    data, reference = open_store(stores, kind), make_dataset()
    problems = []
    for grid, manager in managers:
        problems += [f"{grid}: {p}" for p in problems_of(data, manager, boundary, lambda n: reference[n].values)]
    assert not problems, problems


def test_only_the_chunks_of_the_tile_and_its_halo_are_read(managers, stores):
    """Nothing is read by select_tile; then each Zarr chunk (a band of 2 latitudes) the rows touch, once: with
    the Earth too, whose rows beyond a pole are in the polar tile's own bands."""
    chunk_bytes = 2 * W * 8
    problems = []
    for (grid, manager), boundary in itertools.product(managers, (None, "earth")):
        store = CountingStore(zarr.storage.LocalStore(stores["zarr"], read_only=True))
        data = xr.open_zarr(store, consolidated=False, chunks=None)
        store.reset()
        tile = select_tile(data, manager, halo=1, boundary=boundary)
        if store.bytes_read:
            problems.append(f"{grid}: select_tile read {store.bytes_read} bytes")
        tile["t"].isel(time=1, level=0).values
        rows = window(manager, (H, W), (1, 1))[-2]
        start, stop = max(0, rows.start - 1), min(H, rows.stop - 1)  # the padded rows inside the field
        bands = (stop - 1) // 2 - start // 2 + 1
        if (store.bytes_read, store.reads) != (bands * chunk_bytes, bands):
            problems.append(f"{grid} {boundary}: rank {manager.rank} read {store.reads} chunks ({store.bytes_read} bytes) for "
                            f"rows {start}:{stop}, expected {bands} ({bands * chunk_bytes} bytes)")
    assert not problems, problems


def mistakes(world):
    """name: (what every rank passes to select_tile, the exception, its message)."""
    last = world.rank == world.size - 1
    data = make_dataset()
    other = data.assign_coords(latitude=np.linspace(-90, 90, H)[::-1] + 0.5)
    shuffled = data.isel(latitude=[1, 0] + list(range(2, H)))
    return {
        "missing lat": ((data, dict(lat="lat" if last else "latitude")), ValueError,
                        r"lat='lat' is not a dim of the data, whose dims are \['time', 'level', 'latitude', 'longitude'\]"),
        "not monotonic": ((shuffled, {}), ValueError, "latitude coordinate 'latitude' is not monotonic"),
        "halo too wide": ((data, dict(halo=H + 1)), ValueError, "wider than the smallest tile"),
        "earth and periodic": ((data, dict(boundary="earth", periodic=True)), ValueError, "drop periodic="),
        "another file": ((other if last else data, {}), ValueError, "did a rank open another file"),
        "not xarray": ((data["t"].values, {}), TypeError, "takes an xarray.Dataset or xarray.DataArray"),
    }


def test_a_manager_of_longitude_slabs_is_refused_on_every_rank(world):
    with DomainParallelManager(world.size, world.size, -1) as manager:
        with pytest.raises(ValueError, match=r"the manager shards dims \(-1,\); build the manager with shard_dim=-2"):
            select_tile(make_dataset(), manager)


@pytest.mark.parametrize("name", ["missing lat", "not monotonic", "halo too wide", "earth and periodic",
                                  "another file", "not xarray"])
def test_bad_input_raises_alike_on_every_rank(world, managers, name):
    if name == "another file" and world.size == 1:
        pytest.skip("needs a second rank to disagree with")
    (data, keywords), kind, message = mistakes(world)[name]
    for grid, manager in managers:
        with pytest.raises(kind, match=message):
            select_tile(data, manager, **keywords)


def test_a_data_array_without_a_manager_is_the_whole_field_padded(world):
    """With no manager in a one-process job the tile is the whole field; a DataArray stays a DataArray."""
    if world.size > 1:
        pytest.skip("no manager is an error in a job of several processes")
    field = make_dataset()["sp"]
    padded = select_tile(field, halo=2, boundary="earth")
    assert isinstance(padded, xr.DataArray) and padded.name == "sp"
    assert np.array_equal(padded.values, global_pad(field.values, (2, 2), "earth"))
    assert np.array_equal(padded.latitude.values[:3], [90 - 15, 90, 90])  # mirrored rows' latitudes


@pytest.mark.parametrize("boundary", ["earth", "zeros"])
def test_tile_dataset_stacks_normalised_channels_and_splits_samples_over_data_parallel(world, boundary):
    """Each item is the normalised global sample, padded (the halos of zeros stay zeros), cut to the rank's tile;
    every rank of a domain group reads the same indices, the data-parallel ranks different ones."""
    from mpidomain.data import TileDataset

    domain = 2 if world.size % 2 == 0 and world.size > 2 else 1
    data = make_dataset()
    mean = xr.Dataset({"t": ("level", [0.5, -0.25]), "sp": 1.5})
    std = xr.Dataset({"t": ("level", [2.0, 4.0]), "sp": 0.5})
    problems = []
    with DomainParallelManager(world.size, domain) as manager:
        samples = TileDataset(data, ["sp", "t"], levels=[850, 500], manager=manager, halo=(1, 1),
                              **BOUNDARIES[boundary][0], mean=mean, std=std)
        assert samples.channels == ("t@850", "t@500", "sp") and len(samples) == 2
        for index in range(len(samples)):
            step = data.isel(time=index)
            stacked = np.stack([(step["t"].sel(level=850).values - -0.25) / 4.0,
                                (step["t"].sel(level=500).values - 0.5) / 2.0,
                                (step["sp"].values - 1.5) / 0.5])
            want = torch.from_numpy(global_pad(stacked, (1, 1), boundary)[window(manager, stacked.shape, (1, 1))])
            got = samples[index]
            if got.dtype != torch.float32 or not torch.equal(got, want.to(torch.float32)):
                problems.append(f"rank {world.rank}: sample {index} differs from the normalised global sample")
        indices = list(samples.sampler(seed=3))
        everyone = world.allgather((manager.dp_rank, indices))
    for dp_rank, theirs in everyone:
        mine = [i for r, i in everyone if r == dp_rank]
        if any(m != theirs for m in mine):
            problems.append(f"data-parallel rank {dp_rank}'s domain group read different indices: {mine}")
    per_replica = {r: tuple(i) for r, i in everyone}
    flat = [i for indices in per_replica.values() for i in indices]
    replicas, count = len(per_replica), len(samples)
    # Every sample once; DistributedSampler repeats the first ones to give each replica ceil(count / replicas).
    if replicas > 1 and (sorted(set(flat)) != list(range(count)) or len(flat) != replicas * -(-count // replicas)):
        problems.append(f"the data-parallel ranks' indices overlap or miss samples: {per_replica}")
    assert not problems, problems


def test_tile_dataset_mistakes_raise_alike_on_every_rank(world, managers):
    from mpidomain.data import TileDataset

    last = world.rank == world.size - 1
    _, manager = managers[0]
    with pytest.raises(ValueError, match=r"variables \['q'\] are not in the data, whose variables are"):
        TileDataset(make_dataset(), ["t", "q"] if last else ["t"], manager=manager)
    with pytest.raises(ValueError, match=r"levels \[300\] are not in 'level', whose values are \[500, 850\]"):
        TileDataset(make_dataset(), ["t"], levels=[300], manager=manager)
    if world.size > 1:
        with pytest.raises(ValueError, match="TileDataset needs the same arguments on every rank"):
            TileDataset(make_dataset(), ["sp"] if last else ["t"], manager=manager)

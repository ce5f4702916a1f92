"""Read and write only your tile: bytes, peak memory and time per rank, against whole samples on every rank or one.

    mpiexec -n 1 python scripts/bench/bench_io.py
    mpiexec -n 2 python scripts/bench/bench_io.py
    mpiexec -n 4 python scripts/bench/bench_io.py            # --tiles 2x2, --levels 8, --steps 3, --halo 2
    mpiexec -n 2 python scripts/bench/bench_io.py --shape 37,72 --levels 2 --steps 1   # a quick look
    mpiexec -n 1 python scripts/bench/bench_io.py --steps 8 --workers 0,1,2 --compute-ms 150   # DataLoader workers

Rank 0 writes a synthetic ERA5-like Zarr store twice into ``--dir`` (default: a new temporary
directory, removed at the end): variables ``t`` and ``u`` (time x level x 721 x 1440 float32) and
``sp`` (time x 721 x 1440), uncompressed (so bytes stored are bytes of data), chunked

- ``time``: as ERA5 ARCO stores are, one chunk per time step and variable (all levels, the whole
  globe in one chunk);
- ``bands``: one chunk per time step, variable and band of ``--band`` latitudes (all levels, all
  longitudes).

All ranks form one domain group (latitude slabs, or ``--tiles`` D_lat x D_lon). Each rank builds
every time step's sample, all channels (t and u at every level, then sp), as its tile with a
``--halo`` of the Earth's boundary (``boundary="earth"``), two ways that give the same tensor
(checked, bit for bit):

- ``whole+shard`` (the baseline, what examples do today): open the store, read the whole sample,
  ``shard_tensor`` it, ``halo_exchange`` the tile;
- ``select_tile``: ``TileDataset(store, ..., halo, boundary="earth")[step]``: the tile and its
  halos read straight from the store.

Reported per rank (the maximum over ranks): bytes read from the store per sample (counted by
:class:`mpidomain.data.CountingStore`, metadata excluded) and as a fraction of the whole sample;
peak resident memory while building the samples (Linux's VmHWM, reset before each method, less
the resident memory before: what the method added; glibc set to return freed blocks at once;
both methods run once untimed first); wall time per sample (slowest rank, median
over steps). Ratios are select_tile over the baseline in the same run. The store was just
written, so reads come from the page cache: times measure decoding and copying, not a disk.

Then writing: each rank holds its tile of every sample (read with ``select_tile``, untimed) and
the samples go into a new store, one call per time step appended along ``time``, two ways that
give the same store (checked: the datasets equal):

- ``gather+write`` (the baseline): ``gather_tensor`` every variable's whole field, rank 0 writes
  it with xarray's ``to_zarr``;
- ``write_tile``: every rank writes the chunks whose first row and column its tile holds, after
  the ranks that share them sent it their rows.

Two chunkings of the written store: ``tiles`` (each chunk as large as the largest tile, write_tile's
default) and ``bands`` (``--band`` latitudes by the default longitude chunk, the largest tile's
columns, so all longitudes on slabs: chunks that straddle tiles). Reported
per rank (the maximum over ranks): bytes written per sample (counted by ``CountingStore``, metadata
and coordinates included, zarr's default zstd compression on), as a fraction of the field's raw
bytes and of all ranks' bytes together (the store's: ``1/D`` plus chunk rounding is the goal), the
peak resident memory added, and wall time per sample (slowest rank, median over steps).

Then reading through a ``torch.utils.data.DataLoader`` (the bands store, ``TileDataset``, its data-parallel
sampler, batch 1) with each of ``--workers`` worker counts (``persistent_workers`` and ``prefetch_factor=2``
with workers; ``--context``: fork, spawn or forkserver), ``--compute-ms`` of work on a busy core after each
sample (a training step's stand-in: what workers read behind): samples per second per rank over ``--epochs``
epochs after one untimed epoch (the workers' start), the slowest rank's, against the first count (``0``) in
the same run; the samples are checked to equal the first count's, in the same order (digests).
"""

import argparse
import ctypes
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import xarray as xr  # noqa: E402
import zarr  # noqa: E402

import mpidomain  # noqa: E402
from mpidomain.data import CountingStore, TileDataset, select_tile, write_tile  # noqa: E402

WORLD = MPI.COMM_WORLD
VARIABLES = ("t", "u", "sp")
warnings.filterwarnings("ignore", message=".*[Cc]onsolidated metadata.*")
warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: measured anyway


def parse():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="721,1440", help="latitudes,longitudes (default 721,1440)")
    parser.add_argument("--levels", type=int, default=4, help="pressure levels of t and u (default 4)")
    parser.add_argument("--steps", type=int, default=2, help="time steps, one sample each (default 2)")
    parser.add_argument("--band", type=int, default=45, help="latitudes per chunk of the bands store (default 45)")
    parser.add_argument("--halo", type=int, default=1, help="halo rows and columns (default 1)")
    parser.add_argument("--tiles", default=None, help="D_lat x D_lon tiles, e.g. 2x2 (default: latitude slabs)")
    parser.add_argument("--dir", default=None, help="where to write the stores (default: a temporary directory)")
    parser.add_argument("--workers", default="0,2", help="DataLoader num_workers to compare (default 0,2)")
    parser.add_argument("--context", default="fork", choices=("fork", "spawn", "forkserver"),
                        help="the workers' multiprocessing start method (default fork)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per worker count (default 3)")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="milliseconds of work (a busy core) per sample after it arrives: a training step's "
                             "stand-in, which workers can read behind (default 0)")
    return parser.parse_args()


def write_stores(root, shape, levels, steps, band):
    """Write the dataset chunked both ways; return the two paths. On rank 0 only."""
    H, W = shape
    latitude, longitude = np.linspace(90, -90, H), np.arange(W) * 360.0 / W
    rng = np.random.default_rng(0)
    fields = {name: rng.standard_normal((steps, levels, H, W), dtype=np.float32) for name in ("t", "u")}
    fields["sp"] = rng.standard_normal((steps, H, W), dtype=np.float32)
    data = xr.Dataset(
        {n: (("time", "level", "latitude", "longitude") if v.ndim == 4 else ("time", "latitude", "longitude"), v)
         for n, v in fields.items()},
        coords={"time": np.arange(steps), "level": np.arange(levels) * 100 + 300, "latitude": latitude,
                "longitude": longitude})
    paths = {}
    for chunking, rows in (("time", H), ("bands", band)):
        encoding = {n: {"chunks": (1, levels, rows, W) if fields[n].ndim == 4 else (1, rows, W), "compressors": None}
                    for n in fields}
        paths[chunking] = os.path.join(root, f"{chunking}.zarr")
        data.to_zarr(paths[chunking], mode="w", encoding=encoding, consolidated=False, zarr_format=3)
    return paths


def resident_kib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def return_freed_memory():
    """Make glibc give large freed blocks back to the system at once, so resident memory is what is held.

    By default glibc raises its mmap threshold after a large free and keeps later blocks in its heap;
    the peak of one method would then hide in memory an earlier one freed.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: blocks of 128 KiB or more get their own mapping
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD


def reset_peak():
    """Reset VmHWM to the current resident memory (Linux >= 4.0); return that."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass
    return resident_kib("VmRSS")


def whole_then_shard(store, manager, halo, steps):
    """The baseline's samples: the whole sample on every rank, then its tile, then the halos."""
    data = xr.open_zarr(store, consolidated=False, chunks=None)
    store.reset()
    for step in range(min(steps, data.sizes["time"])):
        started = time.perf_counter()
        sample = data.isel(time=step)
        whole = np.concatenate([sample[v].values if v != "sp" else sample[v].values[None] for v in VARIABLES])
        tile = mpidomain.shard_tensor(torch.from_numpy(whole), manager=manager, allow_uneven=True)
        padded = mpidomain.halo_exchange(tile, halo, boundary="earth", manager=manager)
        del whole, tile
        yield padded, time.perf_counter() - started


def straight_to_tile(store, manager, halo, steps):
    """select_tile's samples: TileDataset reads the tile and its halos only."""
    data = xr.open_zarr(store, consolidated=False, chunks=None)
    samples = TileDataset(data, VARIABLES, manager=manager, halo=halo, boundary="earth")
    store.reset()
    for step in range(min(steps, len(samples))):
        started = time.perf_counter()
        padded = samples[step]
        yield padded, time.perf_counter() - started


def measure(method, path, manager, halo, steps):
    """Run ``method`` over ``steps`` steps; return (bytes per sample, peak KiB added, median seconds, digests).

    Only each sample's digest is kept: a sample is dropped before the next is built, as in training.
    """
    before = reset_peak()
    store = CountingStore(zarr.storage.LocalStore(path, read_only=True))
    times, samples = [], []
    for padded, seconds in method(store, manager, halo, steps):
        times.append(seconds)
        samples.append(hashlib.blake2b(np.ascontiguousarray(padded.numpy()).data).hexdigest())
        del padded
    peak = resident_kib("VmHWM") - before
    return store.bytes_read / len(times), peak, statistics.median(times), samples


def tiles_of(path, manager, steps):
    """This rank's tile of every time step (t, u and sp, halo-free), loaded: what the writers write."""
    data = xr.open_zarr(path, consolidated=False, chunks=None)
    return [select_tile(data.isel(time=slice(step, step + 1)), manager).load() for step in range(steps)]


def by_tiles(tiles, path, manager, chunks, everything):
    """write_tile's samples: every rank writes its chunks, one call per step."""
    store = CountingStore(zarr.storage.LocalStore(path))
    for tile in tiles:
        started = time.perf_counter()
        write_tile(tile, store, manager, append_dim="time", chunks=chunks)
        yield store, time.perf_counter() - started


def gathered(tiles, path, manager, chunks, everything):
    """The baseline's samples: every variable's whole field gathered, written by rank 0 with xarray."""
    store = CountingStore(zarr.storage.LocalStore(path))
    for step, tile in enumerate(tiles):
        started = time.perf_counter()
        whole = {n: mpidomain.gather_tensor(np.ascontiguousarray(tile[n].values), manager=manager) for n in VARIABLES}
        if WORLD.rank == 0:
            coords = {n: everything[n].values for n in ("level", "latitude", "longitude")}
            sample = xr.Dataset({n: (tile[n].dims, whole[n]) for n in VARIABLES},
                                coords=dict(coords, time=tile.time.values))
            if step == 0:
                encoding = {n: {"chunks": tuple(dict(sample.sizes, time=1, **chunks)[d] for d in sample[n].dims)}
                            for n in VARIABLES}
                sample.to_zarr(store, mode="w", encoding=encoding | {"time": {"chunks": (1,)}}, consolidated=False,
                               zarr_format=3)
            else:
                sample.to_zarr(store, append_dim="time", consolidated=False)
        del whole
        yield store, time.perf_counter() - started


def measure_writes(method, tiles, path, manager, chunks, everything):
    """Run ``method``; return (bytes written per sample, peak KiB added, median seconds)."""
    before = reset_peak()
    times, store = [], None
    for store, seconds in method(tiles, path, manager, chunks, everything):
        times.append(seconds)
    peak = resident_kib("VmHWM") - before
    return store.bytes_written / len(times), peak, statistics.median(times)


def write_section(args, manager, paths, root, shape, tiles_grid, field_bytes):
    """Write the samples both ways and both chunkings; print a row each; return the ratio lines."""
    tiles = tiles_of(paths["bands"], manager, args.steps)
    everything = xr.open_zarr(paths["bands"], consolidated=False, chunks=None)
    extents = [mpidomain.balanced_split(n, parts)[0][0] for n, parts in zip(shape, tiles_grid)]  # the largest tile
    chunkings = {"tiles": {"latitude": extents[0], "longitude": extents[1]}, "bands": {"latitude": args.band}}
    if WORLD.rank == 0:
        print(f"{'ranks':>5} {'chunks':>6} {'method':>12} {'MiB written/rank':>16} {'of field':>8} {'of store':>8} "
              f"{'peak MiB/rank':>13} {'s/sample':>9}")
    for name, method in (("gather+write", gathered), ("write_tile", by_tiles)):  # warm up
        measure_writes(method, tiles[:1], os.path.join(root, f"warm-{name}.zarr"), manager, chunkings["bands"],
                       everything)
    ratios = []
    for chunking, chunks in chunkings.items():
        results, stores = {}, {}
        for name, method in (("gather+write", gathered), ("write_tile", by_tiles)):
            stores[name] = os.path.join(root, f"written-{chunking}-{name}.zarr")
            WORLD.Barrier()
            written, peak, seconds = measure_writes(method, tiles, stores[name], manager, chunks, everything)
            total = WORLD.allreduce(written)
            written, peak, seconds = (WORLD.allreduce(v, op=MPI.MAX) for v in (written, peak, seconds))
            results[name] = (written, peak, seconds)
            if WORLD.rank == 0:
                print(f"{WORLD.size:>5} {chunking:>6} {name:>12} {written / 2**20:>16.2f} "
                      f"{written / field_bytes:>8.3f} {written / total:>8.3f} {peak / 1024:>13.1f} {seconds:>9.3f}")
        same = True
        if WORLD.rank == 0:
            a, b = (xr.open_zarr(stores[n], consolidated=False, chunks=None).load() for n in stores)
            same = a.identical(b)
        if not WORLD.bcast(same):
            raise SystemExit(f"bench_io: write_tile's store differs from the baseline's ({chunking} chunks)")
        base, new = results["gather+write"], results["write_tile"]
        ratios.append(f"{chunking} chunks: write_tile / gather+write: bytes written/rank {new[0] / base[0]:.3f}x, "
                      f"peak memory {new[1] / max(base[1], 1):.3f}x, time {new[2] / base[2]:.3f}x")
    return ratios


def busy(seconds):
    """Keep this core busy for ``seconds``: a training step's stand-in."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def load_all(dataset, sampler, workers, context, epochs, compute):
    """(samples per second over ``epochs`` timed epochs after an untimed one, every sample's digest) of a
    DataLoader with ``workers`` worker processes; ``compute`` seconds of work per sample in between."""
    options = dict(num_workers=workers)
    if workers:
        options.update(persistent_workers=True, prefetch_factor=2, multiprocessing_context=context)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler, **options)
    for batch in loader:  # untimed: the workers start
        pass
    digests, began = [], time.perf_counter()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            digests.append(hashlib.blake2b(np.ascontiguousarray(batch.numpy()).data).hexdigest())
            busy(compute)
    seconds = time.perf_counter() - began
    del loader
    return len(digests) / seconds, digests


def loader_section(args, manager, paths):
    """The DataLoader workers' table; return its summary line."""
    counts = [int(n) for n in args.workers.split(",")]
    data = xr.open_zarr(paths["bands"], consolidated=False, chunks=None)
    dataset = TileDataset(data, VARIABLES, manager=manager, halo=args.halo, boundary="earth")
    sampler = dataset.sampler(shuffle=True, seed=0)
    if WORLD.rank == 0:
        print(f"DataLoader over TileDataset (bands chunks, batch 1, {len(sampler)} samples per epoch per rank, "
              f"{args.epochs} epochs timed, workers started by {args.context}, {args.compute_ms:g} ms of work per "
              "sample):")
        print(f"{'ranks':>5} {'workers':>7} {'samples/s/rank':>14} {'vs first':>9}")
    results = {}
    for workers in counts:
        WORLD.Barrier()
        rate, digests = load_all(dataset, sampler, workers, args.context, args.epochs, args.compute_ms / 1000)
        rate = WORLD.allreduce(rate, op=MPI.MIN)
        results[workers] = (rate, digests)
        if WORLD.rank == 0:
            print(f"{WORLD.size:>5} {workers:>7} {rate:>14.2f} {f'x {rate / results[counts[0]][0]:.2f}':>9}")
    same = all(d == results[counts[0]][1] for _, d in results.values())
    if not WORLD.allreduce(same, op=MPI.LAND):
        raise SystemExit(f"bench_io: the DataLoader workers gave other samples, or another order, than "
                         f"num_workers={counts[0]}")
    best = max(counts, key=lambda n: results[n][0])
    base = results[counts[0]][0]
    if best == counts[0]:
        return [f"DataLoader: no worker count read faster than num_workers={counts[0]} ({base:.2f} samples/s per "
                "rank) here; the same samples in the same order"]
    return [f"DataLoader: {results[best][0]:.2f} samples/s per rank with {best} workers against {base:.2f} with "
            f"{counts[0]}: x {results[best][0] / base:.2f}; the same samples in the same order"]


def main():
    args = parse()
    return_freed_memory()
    shape = tuple(int(n) for n in args.shape.split(","))
    tiles = tuple(int(n) for n in args.tiles.split("x")) if args.tiles else None
    manager = mpidomain.DomainParallelManager(WORLD.size, tiles or WORLD.size, (-2, -1) if tiles else -2)
    root = None
    if WORLD.rank == 0:
        root = args.dir or tempfile.mkdtemp(prefix="bench_io_")
        os.makedirs(root, exist_ok=True)
        paths = write_stores(root, shape, args.levels, args.steps, args.band)
    paths = WORLD.bcast(paths if WORLD.rank == 0 else None)
    root = WORLD.bcast(root)
    WORLD.Barrier()
    channels = 2 * args.levels + 1
    whole_bytes = channels * shape[0] * shape[1] * 4
    layout = f"{tiles[0]}x{tiles[1]} tiles" if tiles else f"{WORLD.size} latitude slabs"
    if WORLD.rank == 0:
        print(f"bench_io: {WORLD.size} ranks ({layout}), sample {channels} x {shape[0]} x {shape[1]} float32 = "
              f"{whole_bytes / 2**20:.1f} MiB, {args.steps} samples, halo {args.halo} (earth), bands of {args.band}")
        print(f"{'ranks':>5} {'chunks':>6} {'method':>12} {'MiB read/rank':>13} {'of sample':>9} "
              f"{'peak MiB/rank':>13} {'s/sample':>9}")
    for method in (whole_then_shard, straight_to_tile):  # warm up: first calls set up xarray, zarr, plans
        measure(method, paths["bands"], manager, args.halo, 1)
    ratios = []
    for chunking in ("time", "bands"):
        results = {}
        for name, method in (("whole+shard", whole_then_shard), ("select_tile", straight_to_tile)):
            WORLD.Barrier()
            read, peak, seconds, samples = measure(method, paths[chunking], manager, args.halo, args.steps)
            read, peak, seconds = (WORLD.allreduce(v, op=MPI.MAX) for v in (read, peak, seconds))
            results[name] = (read, peak, seconds, samples)
            if WORLD.rank == 0:
                print(f"{WORLD.size:>5} {chunking:>6} {name:>12} {read / 2**20:>13.2f} {read / whole_bytes:>9.3f} "
                      f"{peak / 1024:>13.1f} {seconds:>9.3f}")
        same = results["whole+shard"][3] == results["select_tile"][3]
        if not WORLD.allreduce(same, op=MPI.LAND):
            raise SystemExit(f"bench_io: select_tile's samples differ from the baseline's ({chunking} chunks)")
        base, new = results["whole+shard"], results["select_tile"]
        ratios.append(f"{chunking} chunks: select_tile / whole+shard: bytes {new[0] / base[0]:.3f}x, "
                      f"peak memory {new[1] / max(base[1], 1):.3f}x, time {new[2] / base[2]:.3f}x")
    ratios += write_section(args, manager, paths, root, shape, tiles or (WORLD.size, 1), whole_bytes)
    ratios += loader_section(args, manager, paths)
    if WORLD.rank == 0:
        for line in ratios:
            print(line)
        print("stores written equal the baseline's (datasets): yes")
        print("samples equal bit for bit (digests): yes")
        if args.dir is None:
            shutil.rmtree(root)
    manager.close()


if __name__ == "__main__":
    main()

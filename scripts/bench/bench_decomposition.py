"""Compare 1-D latitude slabs with 2-D latitude x longitude tiles: halo bytes, messages and exchange time.

    mpiexec -n 4 python scripts/bench/bench_decomposition.py
    mpiexec -n 16 python scripts/bench/bench_decomposition.py            # or --tiles 2x8, --repeats 100, --halo 2,1
    mpiexec -n 4 python scripts/bench/bench_decomposition.py --shape 1,2,37,72 --repeats 2   # a quick look

All ranks form one domain group. The global field (default ``1,64,721,1440`` float32, ERA5 at
64 levels) is split over the ranks two ways: 1-D slabs (D = ranks along latitude, dim -2) and 2-D
tiles (``D_lat x D_lon``: by default the most square factorisation of the rank count, with
``D_lon >= D_lat`` since 1440 > 721; ``--tiles`` overrides), each split as ``balanced_split`` does.
Each is timed with and without ``boundary="earth"``: four variants.

What is compared, and why it is fair: every variant produces, on every rank, the same padded array
a 3x3 convolution needs (``--halo`` rows, default 1, on each side of latitude *and* longitude), and
the two variants of one boundary produce the same padded *global* field, cut to the rank's tile:

- without Earth: zeros beyond the poles, longitude periodic. 1-D slabs do what slab code does
  today: a local periodic longitude pad (``HaloPlan(x, w, -1, periodic=True)``: copies, no
  messages) on the local rows, then the latitude exchange of the full padded rows
  (``HaloPlan(.., h, -2)``, so the corners come along), both inside the timed call; 2-D tiles
  exchange both dims in one plan (``periodic=(False, True)``: longitude wraps across the ranks);
- with Earth: ``HaloPlan(x, (h, w), boundary="earth")`` on either manager (longitude periodic,
  beyond each pole the near-pole rows mirrored, half a turn of longitude away).

Reported per variant: bytes each rank sends to *other* ranks per exchange (max and mean over
ranks; exact, from ``plan.layout.sends``: what would cross a network, independent of the
machine), the bytes it fills by local copies (mean), MPI messages sent per rank (max: one per
peer, the plan packs its blocks for a peer together), and the median
over repeats of the slowest rank's ``plan.exchange(padded)`` (every call after a barrier; the
variants take turns, in a rotating order, so load changes hit them alike), with ratios of bytes
(2-D over 1-D of the same boundary) and of time (over the 1-D slabs without Earth). On one
oversubscribed machine the time measures packing and shared-memory copies, not a network.

Before timing, and again after, every rank checks its padded array (ghost cells first set to NaN,
so an unwritten one fails) against its window of the padded global field. The field's values are
a hash of their global index, so each rank builds its own shard and its expected window from
index arithmetic (the padding rules written out independently of the library) with no global array
and no communication; equal windows also make the 1-D and 2-D results equal to each other.
"""

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpidomain  # noqa: E402
from mpidomain import balanced_split  # noqa: E402

WORLD = MPI.COMM_WORLD
_PRIME = 16_777_213  # below 2**24: every value is an integer exact in float32


def square_tiles(n, extents=(721, 1440)):
    """``(D_lat, D_lon)`` with ``D_lat * D_lon == n``, as square as possible, more ranks along the longer dim."""
    small = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return (small, n // small) if extents[1] >= extents[0] else (n // small, small)


def values(shape, batch, channel, lat, lon):
    """The global field at the given (broadcast) indices: 1 + a hash of the flat index, < 2**24."""
    flat = ((batch * shape[1] + channel) * shape[2] + lat) * shape[3] + lon
    return (1 + flat * 2654435761 % _PRIME).astype(np.float32)


def _grid(shape, lat, lon):
    b, c = np.arange(shape[0]), np.arange(shape[1])
    return b[:, None, None, None], c[None, :, None, None], lat[None, None, :, None], lon[None, None, None, :]


def shard(shape, window):
    """This rank's unpadded tile: global rows ``lat0:lat0+n``, columns ``lon0:lon0+m``."""
    (lat0, n), (lon0, m) = window
    return values(shape, *_grid(shape, np.arange(lat0, lat0 + n), np.arange(lon0, lon0 + m)))


def expected_window(shape, window, halo, earth):
    """This rank's window of the padded global field (zeros or Earth beyond the poles, longitude periodic)."""
    (lat0, n), (lon0, m) = window
    (h, w), (height, width) = halo, shape[-2:]
    lat = np.arange(lat0 - h, lat0 + n + h)
    lon = np.arange(lon0 - w, lon0 + m + w)
    beyond = (lat < 0) | (lat >= height)
    source = np.where(lat < 0, -1 - lat, np.where(lat >= height, 2 * height - 1 - lat, lat))
    # Beyond a pole (Earth): half a turn of longitude away, as np.roll(field, width // 2, axis=-1).
    turn = np.where(beyond, width // 2, 0)[:, None]
    b, c, i, j = _grid(shape, source, lon)
    j = (j - turn[None, None]) % width
    out = values(shape, b, c, i, j)
    if not earth:
        out[..., beyond, :] = 0
    return out


class Variant:
    """One decomposition and boundary: its plans, its padded array and the exchange that refreshes it."""

    def __init__(self, name, manager, x, window, halo, earth):
        self.name, self.manager, self.window, self.earth = name, manager, window, earth
        self.grid = "x".join(map(str, manager.domain_shape if manager.tiled else (manager.domain_parallel_size, 1)))
        h, w = halo
        if earth:
            plans = [mpidomain.HaloPlan(x, (h, w), boundary="earth", manager=manager)]
        elif manager.tiled:
            plans = [mpidomain.HaloPlan(x, (h, w), dim=(-2, -1), periodic=(False, True), manager=manager)]
        else:  # slabs: local periodic longitude pad of the local rows, then latitude rows, corners included
            wide = np.empty(x.shape[:-1] + (x.shape[-1] + 2 * w,), x.dtype)
            plans = [mpidomain.HaloPlan(x, w, -1, periodic=True, manager=manager),
                     mpidomain.HaloPlan(wide, h, -2, manager=manager)]
        self.plans = plans
        self.padded = np.empty(plans[-1].padded_shape, x.dtype)
        # Each plan works on its own view of the padded array: the longitude pad on the local rows.
        local_rows = self.padded[..., h:self.padded.shape[-2] - h, :]
        self.views = [local_rows, self.padded] if len(plans) == 2 else [self.padded]
        self.padded[...] = np.nan
        self.padded[..., h:h + x.shape[-2], w:w + x.shape[-1]] = x
        me = manager.domain_rank
        sends = [(view, m) for plan, view in zip(plans, self.views) for m in plan.layout.sends]
        remote = [view[m.rows].nbytes for view, m in sends if m.peer != me]
        # HaloPlan packs all the blocks for one peer into one message.
        self.messages = sum(len({m.peer for m in plan.layout.sends if m.peer != me}) for plan in plans)
        self.remote_bytes = sum(remote)
        self.local_bytes = sum(view[ghost].nbytes for plan, view in zip(plans, self.views)
                               for _, ghost, _ in plan.layout.copies)
        self.local_bytes += sum(view[m.rows].nbytes for view, m in sends if m.peer == me)

    def exchange(self):
        for plan, view in zip(self.plans, self.views):
            plan.exchange(view)

    def check(self, shape, halo):
        """The number of wrong values in the padded array, against the padded global field."""
        expected = expected_window(shape, self.window, halo, self.earth)
        if expected.shape != self.padded.shape:
            return self.padded.size
        return int(np.count_nonzero(~(self.padded == expected)))

    def free(self):
        for plan in self.plans:
            plan.free()


def windows(manager, shape):
    """This rank's ((lat0, n), (lon0, m)) of ``shape``'s global field under ``manager``'s split."""
    tiles = manager.tiled
    parts = manager.domain_shape if tiles else (manager.domain_parallel_size, 1)
    coords = manager.domain_coords if tiles else (manager.domain_rank, 0)
    found = []
    for extent, p, c in zip(shape[-2:], parts, coords):
        counts, offsets = balanced_split(extent, p)
        found.append((offsets[c], counts[c]))
    return tuple(found)


def verify(variants, shape, halo, when):
    wrong = [v.check(shape, halo) for v in variants]
    everyone = WORLD.gather(wrong, root=0)
    bad = WORLD.bcast(None if WORLD.rank else [(r, v.name, n) for r, counts in enumerate(everyone)
                                               for v, n in zip(variants, counts) if n], root=0)
    if bad:
        if WORLD.rank == 0:
            for rank, name, n in bad[:10]:
                print(f"CHECK FAILED {when}: rank {rank}, {name}: {n} values differ from the padded global field",
                      file=sys.stderr)
        raise SystemExit(1)


def timed(variants, repeats, warmup):
    """Per variant: each repeat's time of the slowest rank (every call after a barrier, rotating order)."""
    for _ in range(warmup):
        for v in variants:
            v.exchange()
    times = np.zeros((len(variants), repeats))
    for r in range(repeats):
        for k in [(r + i) % len(variants) for i in range(len(variants))]:
            WORLD.Barrier()
            start = time.perf_counter()
            variants[k].exchange()
            times[k, r] = time.perf_counter() - start
    slowest = np.empty_like(times)
    WORLD.Allreduce(times, slowest, op=MPI.MAX)
    return [statistics.median(row) for row in slowest]


def _ints(text, sep):
    return tuple(int(part) for part in text.split(sep))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1,64,721,1440", help="global batch,channels,lat,lon (default %(default)s)")
    parser.add_argument("--halo", default="1", help="ghost rows per side: one value, or lat,lon (default %(default)s)")
    parser.add_argument("--tiles", default=None, help="2-D grid D_latxD_lon, e.g. 2x8 (default: most square)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per variant (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    shape = _ints(args.shape, ",")
    halo = _ints(args.halo, ",")
    halo = halo * 2 if len(halo) == 1 else halo
    if len(shape) != 4 or len(halo) != 2:
        raise SystemExit("--shape takes 4 extents (batch, channels, lat, lon); --halo 1 or 2 values")
    n = WORLD.size
    tiles = _ints(args.tiles, "x") if args.tiles else square_tiles(n, shape[-2:])
    if len(tiles) != 2 or math.prod(tiles) != n:
        raise SystemExit(f"--tiles {args.tiles}: D_lat x D_lon must multiply to the {n} ranks")

    slabs = mpidomain.DomainParallelManager(n, n, bind_device="none")
    grid = mpidomain.DomainParallelManager(n, tiles, (-2, -1), bind_device="none")
    variants = []
    for label, manager in (("1-D slabs", slabs), ("2-D tiles", grid)):
        window = windows(manager, shape)
        x = shard(shape, window)
        for earth in (False, True):
            variants.append(Variant(label + (", earth" if earth else ""), manager, x, window, halo, earth))
        del x
    for v in variants:
        v.exchange()
    verify(variants, shape, halo, "before timing")
    medians = timed(variants, args.repeats, args.warmup)
    verify(variants, shape, halo, "after timing")

    counts = WORLD.gather([(v.remote_bytes, v.local_bytes, v.messages) for v in variants], root=0)
    if WORLD.rank == 0:
        kib = 1024.0
        print(f"ranks: {n} (one domain group); field {shape} float32 ({math.prod(shape) * 4 / kib ** 2:.1f} MiB); "
              f"halo (lat, lon) = {halo}; 2-D tiles {tiles[0]}x{tiles[1]}; "
              f"median of {args.repeats} (slowest rank per call); check passed (before and after timing)")
        print(f"MPI: {MPI.Get_library_version().splitlines()[0]}; mpi4py {__import__('mpi4py').__version__}; "
              f"numpy {np.__version__}; {os.cpu_count()} cores")
        print(f"{'variant':20} {'grid':>5} {'padded tile (rank 0)':>22} {'msgs max':>8} {'sent KiB max':>12} "
              f"{'sent KiB mean':>13} {'local KiB mean':>14} {'max vs 1-D':>10} {'mean vs 1-D':>11} {'median ms':>9} "
              f"{'time vs 1-D':>11}")
        for k, v in enumerate(variants):
            sent = [c[k][0] for c in counts]
            slab = [c[k % 2][0] for c in counts]  # the 1-D slabs with the same boundary
            ratios = (max(sent) / max(max(slab), 1), statistics.mean(sent) / max(statistics.mean(slab), 1))
            print(f"{v.name:20} {v.grid:>5} {str(v.padded.shape):>22} {max(c[k][2] for c in counts):8d} "
                  f"{max(sent) / kib:12.1f} {statistics.mean(sent) / kib:13.1f} "
                  f"{statistics.mean(c[k][1] for c in counts) / kib:14.1f} {ratios[0]:9.2f}x {ratios[1]:10.2f}x "
                  f"{medians[k] * 1e3:9.3f} {medians[k] / medians[0]:10.2f}x")
        print("max / mean vs 1-D: bytes sent per rank (max, mean over ranks) over those of the 1-D slabs with "
              "the same boundary; time vs 1-D: over the 1-D slabs without earth")
    for v in variants:
        v.free()
    grid.close()
    slabs.close()


if __name__ == "__main__":
    main()

"""scripts/bench/bench_decomposition.py: its reference windows, and a small 4-rank run printing its four rows."""

import importlib.util
import os

import numpy as np
import pytest

from mpitest import REPO, run_mpi

SCRIPT = os.path.join(REPO, "scripts", "bench", "bench_decomposition.py")
NAMES = ["1-D slabs", "1-D slabs, earth", "2-D tiles", "2-D tiles, earth"]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decomposition", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_square_tiles_prefer_longitude():
    bench = _bench()
    assert [bench.square_tiles(n) for n in (1, 2, 4, 6, 8, 12, 16)] == [
        (1, 1), (1, 2), (2, 2), (2, 3), (2, 4), (3, 4), (4, 4)]


@pytest.mark.parametrize("earth", [False, True])
def test_expected_window_is_the_padded_global_field(earth):
    # The benchmark's check compares with windows built from index arithmetic: they must be
    # windows of the padded global field (CREDIT's earth padding: np.roll, mirror, wrap).
    bench = _bench()
    shape, (h, w) = (1, 2, 9, 10), (2, 1)
    full = bench.shard(shape, ((0, 9), (0, 10)))
    if earth:
        turned = np.roll(full, shape[-1] // 2, axis=-1)
        rows = np.concatenate([turned[..., h - 1::-1, :], full, turned[..., :-h - 1:-1, :]], axis=-2)
    else:
        rows = np.pad(full, [(0, 0), (0, 0), (h, h), (0, 0)])
    padded = np.pad(rows, [(0, 0), (0, 0), (0, 0), (w, w)], mode="wrap")
    for (lat0, n), (lon0, m) in [((0, 4), (0, 5)), ((4, 5), (5, 5)), ((0, 9), (0, 10)), ((3, 2), (7, 3))]:
        window = bench.expected_window(shape, ((lat0, n), (lon0, m)), (h, w), earth)
        assert np.array_equal(window, padded[..., lat0:lat0 + n + 2 * h, lon0:lon0 + m + 2 * w])


@pytest.mark.bench
@pytest.mark.mpi_job
def test_bench_decomposition_tiles_send_fewer_bytes(world):
    if world.size > 1:
        pytest.skip("starts its own 4-rank job: only when the suite runs serially")
    result = run_mpi(4, [SCRIPT, "--shape", "1,4,37,72", "--repeats", "2"], timeout=240)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ranks: 4 ") and "2-D tiles 2x2" in lines[0] and "check passed" in lines[0], lines
    header = next(i for i, line in enumerate(lines) if line.startswith("variant"))
    # name, grid, padded tile, then: msgs, sent KiB max and mean, local KiB mean, max and mean vs 1-D, ms, time vs 1-D
    rows = {line[:20].strip(): (line[20:].split()[0], line.split(")")[-1].split())
            for line in lines[header + 1:header + 5]}
    assert list(rows) == NAMES, lines
    assert [grid for grid, _ in rows.values()] == ["4x1", "4x1", "2x2", "2x2"], lines
    assert rows["1-D slabs"][1][4:6] == ["1.00x", "1.00x"] and rows["1-D slabs"][1][7] == "1.00x", lines
    assert rows["1-D slabs"][1][0] == "2", lines  # the slab baseline: one message to each neighbour
    ratio = {name: [float(r.rstrip("x")) for r in values[4:6]] for name, (_, values) in rows.items()}
    for slab, tile in ((NAMES[0], NAMES[2]), (NAMES[1], NAMES[3])):
        # 72 columns, 37 rows: a 2x2 tile's halo is shorter than a slab's two full-width rows,
        # so the busiest rank sends fewer bytes.
        assert 0 < float(rows[tile][1][1]) < float(rows[slab][1][1]), lines
        assert 0 < ratio[tile][0] < 1, lines
    # On average too without Earth; with it, the slabs at the poles fold locally, so at 4 ranks
    # the mean is no higher (the same bytes: one full row at each pole, two elsewhere).
    assert ratio[NAMES[2]][1] < 1 and ratio[NAMES[3]][1] <= 1, lines

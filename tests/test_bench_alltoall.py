"""``scripts/bench/bench_alltoall.py``: the window attention's all-to-all on 2 x 2 tiles, both dims at once against one
dim after the other (exact byte counts, checked against CommStats of a training step)."""

import os

import pytest

from mpitest import REPO, run_mpi, share

pytestmark = [pytest.mark.bench, pytest.mark.mpi_job]

SCRIPT = os.path.join(REPO, "scripts", "bench", "bench_alltoall.py")


def test_bench_alltoall_prints_its_table(world):
    """CREDIT's small CrossFormer on 128 x 64 (or the skip line): the pair sends 0.75 of the two moves, and its
    column equals what CommStats counts in a real step."""
    pytest.importorskip("torch")
    result = None
    if world.rank == 0:
        result = run_mpi(4, [SCRIPT, "--grid", "128x64"], timeout=300)
        result = (result.returncode, result.stdout, result.stderr)
    code, stdout, stderr = share(world, result)
    assert code == 0, stdout + stderr
    if "CrossFormer: skipped" in stdout:
        assert "miles-credit" in stdout, stdout
        return
    total = [line.split() for line in stdout.splitlines() if line.startswith("total")]
    assert len(total) == 1 and total[0][-1] == "0.750", stdout
    assert int(total[0][-2].replace(",", "")) > 0, stdout
    assert "check:" in stdout and stdout.rstrip().endswith("equal"), stdout


def test_bench_alltoall_refuses_a_layout_it_cannot_make(world):
    """--tiles whose product is not the ranks: one line, exit status 2."""
    result = None
    if world.rank == 0:
        result = run_mpi(2, [SCRIPT, "--tiles", "2x2"], timeout=120)
        result = (result.returncode, result.stdout, result.stderr)
    code, stdout, stderr = share(world, result)
    assert code == 2 and "needs two counts >= 2 whose product is the 2 ranks" in stderr, stdout + stderr

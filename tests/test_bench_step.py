"""``scripts/bench/bench_step.py`` runs a training step at D=1 and D=2 and prints its table (times are not asserted)."""

import os

import pytest

from mpitest import REPO, run_mpi, share

pytestmark = [pytest.mark.bench, pytest.mark.mpi_job]

SCRIPT = os.path.join(REPO, "scripts", "bench", "bench_step.py")


def _rows(stdout, model):
    return [line.split() for line in stdout.splitlines() if line.startswith(model + " ") and "%" in line]


def test_bench_step_prints_its_table(world):
    """The CNN on 32 x 64 (and CREDIT's CrossFormer on 128 x 64, or its skip line): one D=1 row, two D=2 rows."""
    pytest.importorskip("torch")
    result = None
    if world.rank == 0:
        result = run_mpi(2, [SCRIPT, "--grid", "128x64", "--repeats", "1"], timeout=400)
        result = (result.returncode, result.stdout, result.stderr)
    code, stdout, stderr = share(world, result)
    assert code == 0, stderr
    for model in ("cnn", "crossformer"):
        if f"{model}: skipped" in stdout:
            assert model == "crossformer" and "miles-credit" in stdout, stdout
            continue
        rows = _rows(stdout, model)
        assert [(r[1], r[3]) for r in rows] == [("1", "0"), ("2", "0"), ("2", "1")], stdout
        assert all(len(r) == 10 and r[-2] == "x" or len(r) == 11 for r in rows), stdout
        assert rows[0][-1] == "0" and all(int(r[-1].replace(",", "")) > 0 for r in rows[1:]), stdout
        assert sum(line.startswith(f"{model}: step at D=2") and "parallel efficiency" in line
                   for line in stdout.splitlines()) == 1, stdout
        assert stdout.count("bytes sent per step") >= 2, stdout


def test_bench_step_projects_bytes(world):
    """--bytes: one row per D = 2 .. 64 at 1 and 0.25 degrees, without MPI ranks (or CREDIT's skip line)."""
    pytest.importorskip("torch")
    result = None
    if world.rank == 0:
        result = run_mpi(1, [SCRIPT, "--bytes"], timeout=300)
        result = (result.returncode, result.stdout, result.stderr)
    code, stdout, stderr = share(world, result)
    assert code == 0, stderr
    if "--bytes: skipped" in stdout:
        return
    rows = [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [2, 4, 8, 16, 32, 64] * 2, stdout
    assert all(r[8].endswith("%") for r in rows), stdout
    # at D=2, 1 degree: the bytes CommStats counts (scripts/bench/bench_step.py; tests/test_comm_stats.py checks them)
    assert rows[0][1:7] == ["725,408", "544,768", "1,835,008", "0", "1,584", "1,331,496"], stdout


def test_bench_step_projects_step_time(world):
    """--project with a given compute time: one row per D = 4 .. 64, efficiency at most 1 (or CREDIT's skip line)."""
    pytest.importorskip("torch")
    result = None
    if world.rank == 0:
        result = run_mpi(1, [SCRIPT, "--project", "--compute-seconds", "0.5", "--bandwidth", "10", "--latency", "5"],
                         timeout=300)
        result = (result.returncode, result.stdout, result.stderr)
    code, stdout, stderr = share(world, result)
    assert code == 0, stderr
    if "--project: skipped" in stdout:
        return
    assert "10 GB/s per rank, 5 us per message" in stdout and "no overlap" in stdout, stdout
    rows = [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [4, 8, 16, 32, 64], stdout
    for r in rows:
        compute, comm, step, efficiency = (float(v) for v in r[1:5])
        assert compute == pytest.approx(0.5 / int(r[0]), abs=1e-4) and comm > 0, stdout
        assert step == pytest.approx(compute + comm, abs=2e-4) and 0 < efficiency <= 1, stdout

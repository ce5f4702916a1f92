"""The benchmark scripts run and print their tables (numbers are not asserted: machines are noisy)."""

import os
import subprocess
import sys

import pytest

from mpitest import REPO, launcher_env, run_mpi

pytestmark = [pytest.mark.bench, pytest.mark.mpi_job]


def _script(name):
    return os.path.join(REPO, "scripts", "bench", name)


def test_bench_manager_prints_ratios(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        result = subprocess.run(
            [sys.executable, _script("bench_manager.py"), "--ranks", "2", "--repeats", "3"],
            env=launcher_env(), capture_output=True, text=True, timeout=240,
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "CREDIT new_group/gloo" in lines[1]
        assert lines[2].split()[0] == "2" and lines[2].endswith("x")


def test_bench_halo_prints_verdicts(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        result = run_mpi(2, [_script("bench_halo.py"), "--repetitions", "1"], timeout=300)
        assert result.returncode == 0, result.stderr
        verdicts = [line for line in result.stdout.splitlines() if "(target" in line]
        # At 2 ranks: six targets on each large case (h=1, h=3), four on the small one;
        # each row says pass or MISS.
        assert len(verdicts) == 16 and all(("pass" in v) != ("MISS" in v) for v in verdicts), result.stdout


def test_bench_layers_prints_a_verdict(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        result = run_mpi(2, [_script("bench_layers.py"), "--repetitions", "1", "--small-only"], timeout=300)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert sum("verdict: overlapped" in line for line in lines) == 1, result.stdout
        assert any(line.rstrip().endswith("x") and "DomainParallelConv2d / local convolution" in line
                   for line in lines), result.stdout


def test_bench_collectives_prints_ratios(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        result = run_mpi(2, [_script("bench_collectives.py"), "--shape", "1", "4", "32", "64", "--rounds", "1"],
                         timeout=300)
        assert result.returncode == 0, result.stderr
        assert "vs raw MPI" in result.stdout and "mpidomain gather_tensor" in result.stdout, result.stdout


def test_bench_mesh_prints_ratios(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        result = run_mpi(4, [_script("bench_mesh.py"), "-T", "2", "-D", "2", "--repeats", "2"], timeout=240)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == "4 ranks, mesh (dp, tp, domain) = (1, 2, 2): MPI communicators, slowest rank", lines
        assert "Split x 3 (the manager's way)" in lines[1] and "x 1.00" in lines[1]
        assert "Create_cart + Sub x 3" in lines[2] and "DomainParallelManager" in lines[3]
        assert "init_device_mesh (baseline)" in lines[5] and "x 1.00" in lines[5]
        assert "DomainParallelManager(torch_bridge=True) + device_mesh" in lines[6]


def test_bench_io_prints_ratios(world):
    """A small store on 2 ranks; started from one world size only (a fresh job costs CI time)."""
    pytest.importorskip("torch")
    pytest.importorskip("xarray")
    pytest.importorskip("zarr")
    if world.size != 1:
        pytest.skip("started from the one-rank runs only")
    result = run_mpi(2, [_script("bench_io.py"), "--shape", "37,72", "--levels", "2", "--steps", "1", "--band", "5"],
                     timeout=240)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert sum(line.split()[:3] == ["2", "bands", "select_tile"] for line in lines) == 1, result.stdout
    assert any(line.startswith("bands chunks: select_tile / whole+shard: bytes 0.") for line in lines), result.stdout
    assert lines[-1] == "samples equal bit for bit (digests): yes", result.stdout

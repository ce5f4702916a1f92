"""The manager benchmark script runs and prints its table (numbers are not asserted)."""

import os
import subprocess
import sys

import pytest

from mpitest import REPO, launcher_env


def test_bench_manager_prints_ratios(world):
    pytest.importorskip("torch")
    if world.rank == 0:
        script = os.path.join(REPO, "scripts", "bench_manager.py")
        result = subprocess.run(
            [sys.executable, script, "--ranks", "2", "--repeats", "3"],
            env=launcher_env(), capture_output=True, text=True, timeout=240,
        )
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert "CREDIT new_group/gloo" in lines[1]
        assert lines[2].split()[0] == "2" and lines[2].endswith("x")

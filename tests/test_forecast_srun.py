"""``python -m mpidomain forecast`` under Slurm's srun: a killed task ends the job, the rerun with
``--resume auto`` completes it, and the scheduler's own warning signal (``srun --signal``) stops it cleanly.

Runs where a Slurm cluster is up (``MPIDOMAIN_TEST_SLURM=1``: CI's srun pass, which runs it once).
"""

import re
import subprocess
import sys

import pytest

from mpitest import REPO, launcher_env, needs_pmi2, needs_slurm, share
from test_forecast_jobs import ENDS_WITHIN, forecast, outcome, reference, same  # noqa: F401 - the fixture

pytestmark = [needs_slurm, needs_pmi2, pytest.mark.mpi_job]


def test_under_srun_a_kill_and_the_schedulers_signal(world, tmp_path, reference):
    result = None
    if world.rank == 0:
        killed = forecast(tmp_path / "killed", fault="kill:step:1:4", launcher="srun")
        rerun = forecast(tmp_path / "killed", "--resume", "auto", launcher="srun")
        killed_outcome = outcome(str(tmp_path / "killed")) if rerun[0] == 0 else None
        # The scheduler's own warning: srun sends SIGUSR1 to every task before the time limit.
        signalled = subprocess.run(
            ["srun", "-n", "4", "-K", "--mpi=pmi2", "--time=1", "--signal=USR1@50", sys.executable, "-m", "mpidomain",
             "forecast", "--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "100000", "--rollout", "3",
             "--out", str(tmp_path / "signalled")], env=launcher_env(), capture_output=True, text=True, timeout=180,
            cwd=REPO)
        result = killed, rerun, killed_outcome, (signalled.returncode, signalled.stdout, signalled.stderr)
    killed, rerun, killed_outcome, signalled = share(world, result)
    assert killed[0] != 0 and killed[5] - killed[4] < ENDS_WITHIN, killed[2][-3000:]
    assert rerun[0] == 0 and same(killed_outcome, reference), rerun[2][-3000:]
    status, stdout, stderr = signalled
    assert status == 0, stderr[-3000:]
    assert re.search(r"^stopped by SIGUSR1 on ranks 0-3 after step \d+: checkpoint", stdout, re.M), stdout

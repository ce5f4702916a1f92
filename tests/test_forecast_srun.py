"""``python -m mpidomain forecast`` under Slurm's srun: a killed task ends the job, the rerun with
``--resume auto`` completes it, and the scheduler's warning signal (``scancel --signal=USR1``, sent by the test
once training has begun) stops it cleanly.

Runs where a Slurm cluster is up (``MPIDOMAIN_TEST_SLURM=1``: CI's srun pass, which runs it once).
"""

import os
import re
import subprocess
import sys
import threading

import pytest

from mpitest import REPO, launcher_env, needs_pmi2, needs_slurm, share
from test_forecast_jobs import ENDS_WITHIN, KILLS_RANKS, forecast, outcome, reference, same  # noqa: F401 - the fixture

pytestmark = [needs_slurm, needs_pmi2, pytest.mark.mpi_job]


def _signalled_when_training(out):
    """Start the forecast under srun, send SIGUSR1 to the job's tasks with ``scancel --signal`` once rank 0 has
    finished its first training step (read from its progress bar), and return (status, stdout, stderr); a failure
    of the test's own steps comes back as status -1 with its message, for every rank to share.

    The test sends the scheduler's warning itself, at a moment it knows: Slurm's own ``--signal=USR1@T`` arrives
    on the controller's periodic check, up to a minute late, and raced the time limit."""
    name, env = f"mpidomain-signal-{os.getpid()}", launcher_env()
    # -u: the tasks' output unbuffered, so tqdm's redraws (ended by \r, not \n) come through as they are drawn.
    job = subprocess.Popen(
        ["srun", "-u", "-n", "4", "-K", "--mpi=pmi2", f"--job-name={name}", "--time=5", sys.executable, "-m",
         "mpidomain", "forecast", "--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "100000",
         "--rollout", "3", "--out", str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO)
    stdout, stderr, first_step = [], [], threading.Event()

    def read(stream, into, watch):
        text = ""
        while piece := stream.read(64):
            into.append(piece)
            text = (text + piece)[-4096:]
            if watch and re.search(r"train:[^|\n\r]*\|[^|]*\|\s*[1-9]\d*/100000", text):
                first_step.set()

    readers = [threading.Thread(target=read, args=(job.stdout, stdout, False), daemon=True),
               threading.Thread(target=read, args=(job.stderr, stderr, True), daemon=True)]  # tqdm's bar
    for reader in readers:
        reader.start()
    try:
        if not first_step.wait(120):
            raise RuntimeError("the forecast took no training step in 120 s")
        subprocess.run(["scancel", "--signal=USR1", f"--name={name}"], env=env, check=True, capture_output=True,
                       timeout=30)
        job.wait(120)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        return -1, "".join(stdout), f"{type(exc).__name__}: {exc}\n" + "".join(stderr)
    finally:
        if job.poll() is None:  # the job itself goes too, not only srun
            subprocess.run(["scancel", f"--name={name}"], env=env, capture_output=True, timeout=30)
            job.kill()
            job.wait()
        for reader in readers:
            reader.join(30)
    return job.returncode, "".join(stdout), "".join(stderr)


def test_under_srun_a_kill_and_the_schedulers_signal(world, tmp_path, reference):
    result = None
    if world.rank == 0:
        # as the kill jobs of test_forecast_jobs.py, whose reference this is: KILLS_RANKS ranks
        killed = forecast(tmp_path / "killed", fault="kill:step:1:4", launcher="srun", ranks=KILLS_RANKS)
        rerun = forecast(tmp_path / "killed", "--resume", "auto", launcher="srun", ranks=KILLS_RANKS)
        killed_outcome = outcome(str(tmp_path / "killed")) if rerun[0] == 0 else None
        result = killed, rerun, killed_outcome, _signalled_when_training(tmp_path / "signalled")
    killed, rerun, killed_outcome, signalled = share(world, result)
    assert killed[0] != 0 and killed[5] - killed[4] < ENDS_WITHIN, killed[2][-3000:]
    assert rerun[0] == 0 and same(killed_outcome, reference), rerun[2][-3000:]
    status, stdout, stderr = signalled
    assert status == 0, stderr[-3000:]
    assert re.search(r"^stopped by SIGUSR1 on ranks 0-3 after step [1-9]\d*: checkpoint", stdout, re.M), stdout

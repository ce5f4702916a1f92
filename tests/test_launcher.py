"""Launcher detection from the environment, and the MPI/launcher mismatch diagnosis."""

import os

import pytest

from mpidomain.launcher import Launcher, check_launcher_world, detect_launcher
from mpitest import run_python

ENVIRONMENTS = {
    "Slurm srun": {"SLURM_JOB_ID": "7", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "2",
                   "SLURM_LOCALID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x1)", "PMI_SIZE": "4", "PMI_RANK": "2"},
    "Open MPI mpirun": {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
    "MPICH Hydra / Intel MPI mpiexec": {"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALNRANKS": "4",
                                        "MPI_LOCALRANKID": "2", "SLURM_JOB_ID": "7"},
    "Cray PALS (PBS mpiexec)": {"PALS_RANKID": "2", "PALS_LOCAL_RANKID": "2", "PMI_SIZE": "4",
                                "PBS_JOBID": "1.desched1"},
    "LSF jsrun": {"JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_RANK": "2", "JSM_NAMESPACE_LOCAL_RANK": "2",
                  "OMPI_COMM_WORLD_SIZE": "4"},
    "Cray aprun (ALPS)": {"ALPS_APP_PE": "2", "PMI_SIZE": "4"},
    "torchrun": {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2",
                 "LOCAL_WORLD_SIZE": "4"},
}


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_detects_each_launcher(name):
    launcher = detect_launcher(ENVIRONMENTS[name])
    assert launcher.name == name
    assert launcher.size == 4 and launcher.rank == 2


def test_no_launcher_is_one_rank():
    launcher = detect_launcher({"PATH": "/usr/bin"})
    assert launcher == Launcher("none")
    check_launcher_world(1, launcher)  # plain python is a valid world of one


def test_detects_the_running_launcher(world):
    launcher = detect_launcher()
    if world.size > 1:
        assert launcher.size == world.size and launcher.rank == world.rank
    if "MPI_LOCALNRANKS" in os.environ:
        assert launcher.name.startswith("MPICH Hydra")
    elif "OMPI_COMM_WORLD_SIZE" in os.environ:
        assert launcher.name == "Open MPI mpirun"
    elif "SLURM_STEP_NUM_TASKS" in os.environ:
        assert launcher.name == "Slurm srun"


@pytest.mark.parametrize("name", sorted(ENVIRONMENTS))
def test_mismatch_names_both_numbers_and_fix(name):
    launcher = detect_launcher(ENVIRONMENTS[name])
    with pytest.raises(RuntimeError) as info:
        check_launcher_world(1, launcher, library="MPICH 5.0")
    message = str(info.value)
    assert "declared 4 processes" in message and "world of 1" in message
    assert ("mpiexec or srun" in message) if name == "torchrun" else ("MPI4PY_LIBMPI" in message)


def test_matching_sizes_pass():
    check_launcher_world(4, detect_launcher(ENVIRONMENTS["Slurm srun"]))


@pytest.mark.mpi_job
def test_mismatch_in_a_real_process(world):
    if world.rank == 0:
        code = "import mpidomain; mpidomain.initialize_domain_parallel(1, 1)"
        env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}
        result = run_python(["-c", code], env=env)
        assert result.returncode != 0
        assert "RuntimeError: Open MPI mpirun declared 4 processes" in result.stderr, result.stderr

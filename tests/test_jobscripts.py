"""The job scripts in scripts/jobs/, run for real: PBS simulated, Slurm where a cluster is up, mpirun locally.

No PBS server can run here: derecho.pbs runs with bash under a simulated PBS environment
(PBS_NODEFILE, PBS_JOBID, PBS_O_WORKDIR, ...) and the mpiexec of mpi4py's MPI, with its
Cray-only flags dropped (MPIDOMAIN_MPIEXEC_FLAGS=""). The Slurm scripts are submitted with
``sbatch --wait`` where ``MPIDOMAIN_TEST_SLURM=1`` (a cluster is up, scripts/ci/ci_slurm_up.sh).
"""

import os
import socket
import subprocess
import sys

import pytest

from mpitest import (OPENMPI_PYTHON, REPO, launcher_env, mpiexec_path, needs_openmpi, needs_pmi2, needs_slurm, open_mpi,
                     open_mpi_env)

SCRIPTS = os.path.join(REPO, "scripts")
# Rank 0 prints one line per rank (gathered: ranks' own lines may interleave): rank, size,
# launcher, working directory, MPICH_GPU_SUPPORT_ENABLED.
PAYLOAD = (
    "import os; from mpi4py import MPI; import mpidomain; w = MPI.COMM_WORLD; "
    "rows = w.gather((w.rank, w.size, mpidomain.detect_launcher().name.replace(' ', '_'), os.getcwd(), "
    "os.environ.get('MPICH_GPU_SUPPORT_ENABLED'))); "
    "[print('payload', *row, flush=True) for row in rows or ()]"
)


def job_env(extra=None):
    """A fresh job's environment, with this python first on PATH (the scripts call `python`)."""
    env = launcher_env({**open_mpi_env(), **(extra or {})})
    env["PATH"] = os.pathsep.join((os.path.dirname(sys.executable), env.get("PATH", "")))
    return env


def payload_lines(out):
    """The payload's lines as (rank, size, launcher, cwd, gpu_support), sorted by rank."""
    rows = [line.split()[1:] for line in out.splitlines() if line.startswith("payload ")]
    return sorted((int(r), int(s), name, cwd, gpu) for r, s, name, cwd, gpu in rows)


def pbs_env(tmp_path, nodes_lines):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("".join(f"{host}\n" for host in nodes_lines))
    return job_env({
        "PBS_ENVIRONMENT": "PBS_BATCH", "PBS_NODEFILE": str(nodefile), "PBS_JOBID": "4242.desched1",
        "PBS_JOBNAME": "mpidomain", "PBS_QUEUE": "main", "PBS_O_WORKDIR": str(tmp_path),
        "PBS_O_HOST": "derecho1", "MPIDOMAIN_MPIEXEC": mpiexec_path(), "MPIDOMAIN_MPIEXEC_FLAGS": "",
    })


def test_scripts_parse():
    for name in ("jobs/derecho.pbs", "jobs/perlmutter.sbatch", "jobs/slurm_generic.sbatch", "jobs/mpirun_local.sh",
                 "ci/ci_slurm_up.sh", "ci/gpu_check.sh"):
        result = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, name)], capture_output=True, text=True)
        assert result.returncode == 0, (name, result.stderr)


needs_ppn = pytest.mark.skipif(open_mpi(), reason="derecho.pbs passes PALS mpiexec's --ppn, which Hydra has and Open MPI lacks")


@needs_ppn
@pytest.mark.mpi_job
def test_derecho_pbs_under_simulated_pbs(world, tmp_path):
    if world.rank == 0:
        env = pbs_env(tmp_path, [socket.gethostname()] * 4)  # one node, mpiprocs=4
        result = subprocess.run(["bash", os.path.join(SCRIPTS, "jobs", "derecho.pbs"), "python", "-c", PAYLOAD],
                                env=env, capture_output=True, text=True, timeout=180, cwd="/")
        assert result.returncode == 0, result.stderr
        assert "mpidomain: PBS job 4242.desched1: 1 node(s) x 4 ranks" in result.stdout, result.stdout
        rows = payload_lines(result.stdout)
        # Four ranks in one world, started from PBS_O_WORKDIR, with Cray MPICH's GPU support on.
        assert rows == [(r, 4, rows[0][2], str(tmp_path), "1") for r in range(4)], rows


@needs_ppn
@pytest.mark.mpi_job
def test_derecho_pbs_command_from_qsub_v(world, tmp_path):
    # qsub -v MPIDOMAIN_COMMAND="..." is how a PBS user replaces the default command.
    if world.rank == 0:
        env = pbs_env(tmp_path, [socket.gethostname()] * 2)
        env.update(MPIDOMAIN_COMMAND="python -m mpidomain info -D 2", MPIDOMAIN_PPN="2",
                   MPICH_GPU_SUPPORT_ENABLED="0")
        result = subprocess.run(["bash", os.path.join(SCRIPTS, "jobs", "derecho.pbs")],
                                env=env, capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr
        assert "world size        : 2 (1 node(s))" in result.stdout, result.stdout
        assert "domain groups     : [0,1]" in result.stdout


@pytest.mark.mpi_job
def test_mpirun_local(world):
    if world.rank == 0:
        result = subprocess.run(["bash", os.path.join(SCRIPTS, "jobs", "mpirun_local.sh"), "-n", "2", "python", "-c",
                                 PAYLOAD], env=job_env(), capture_output=True, text=True, timeout=180, cwd=REPO)
        assert result.returncode == 0, result.stderr
        rows = payload_lines(result.stdout)
        assert [(r, s) for r, s, *_ in rows] == [(0, 2), (1, 2)], result.stdout


@needs_openmpi
@pytest.mark.mpi_job
def test_mpirun_local_with_open_mpi(world):
    # The mpiexec next to Open MPI's python, with --oversubscribe: four ranks on any machine.
    if world.rank == 0:
        env = job_env()
        env["PATH"] = os.pathsep.join((os.path.dirname(OPENMPI_PYTHON), env["PATH"]))
        result = subprocess.run(["bash", os.path.join(SCRIPTS, "jobs", "mpirun_local.sh"), "python", "-c", PAYLOAD],
                                env=env, capture_output=True, text=True, timeout=180, cwd=REPO)
        assert result.returncode == 0, result.stderr
        rows = payload_lines(result.stdout)
        assert [(r, s, name) for r, s, name, *_ in rows] == [(r, 4, "Open_MPI_mpirun") for r in range(4)], result.stdout


def sbatch(tmp_path, *args):
    """Run ``sbatch --wait *args`` (options, script, its arguments) from tmp_path; return (returncode, job output)."""
    command = ["sbatch", "--wait", f"--output={tmp_path}/job-%j.out", f"--chdir={tmp_path}", *args]
    result = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=240)
    outputs = sorted(tmp_path.glob("job-*.out"))
    text = outputs[-1].read_text() if outputs else ""
    return result.returncode, f"{text}\n{result.stderr}"


@needs_slurm
@needs_pmi2
@pytest.mark.mpi_job
def test_slurm_generic_sbatch(world, tmp_path):
    if world.rank == 0:
        code, out = sbatch(tmp_path, "--ntasks-per-node=2", os.path.join(SCRIPTS, "jobs", "slurm_generic.sbatch"),
                           "python", "-c", PAYLOAD)
        assert code == 0, out
        assert "1 node(s), 2 tasks" in out, out
        assert payload_lines(out) == [(r, 2, "Slurm_srun", str(tmp_path), "None") for r in range(2)], out


@needs_slurm
@pytest.mark.mpi_job
def test_perlmutter_sbatch_directives_and_srun_flags(world, tmp_path):
    # Not Perlmutter: the GPU constraint, QOS and GPUs are overridden, and the payload does not
    # start MPI (Cray MPICH's cray_shasta PMI is not here). What runs is the script's own
    # directives and its srun line, four tasks each seeing its Slurm task id.
    if world.rank == 0:
        payload = "import os; print('task', os.environ['SLURM_PROCID'], os.environ['SLURM_MPI_TYPE'], flush=True)"
        code, out = sbatch(tmp_path, "--constraint=", "--qos=", "--gpus-per-node=0", "--cpus-per-task=1",
                           os.path.join(SCRIPTS, "jobs", "perlmutter.sbatch"), "python", "-c", payload)
        assert code == 0, out
        tasks = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("task "))
        assert tasks == [[str(r), "cray_shasta"] for r in range(4)], out

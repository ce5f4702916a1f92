"""End the whole MPI job when any rank dies of an uncaught exception.

Without this, one rank's traceback leaves every other rank waiting in a
collective until the job's wall-clock limit. The hook prints the traceback
prefixed with the rank, then calls ``Abort`` on the world communicator.
"""

import os
import sys
import time
import traceback

from ._mpi import is_active, mpi

__all__ = ["install_abort_on_error", "abort_on_error_enabled"]

_previous_hook = None
_FORWARD_SECONDS = 0.5


def abort_on_error_enabled(requested=None):
    """Return whether to install the hook: ``requested`` if given, else the environment.

    ``MPIDOMAIN_ABORT_ON_ERROR=0`` (or ``false``/``no``/``off``) turns it off.
    """
    if requested is not None:
        return bool(requested)
    value = os.environ.get("MPIDOMAIN_ABORT_ON_ERROR", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _abort_hook(kind, value, tb):
    if not is_active():
        (_previous_hook or sys.__excepthook__)(kind, value, tb)
        return
    world = mpi().COMM_WORLD
    rank = world.Get_rank()
    text = "".join(traceback.format_exception(kind, value, tb))
    prefixed = "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").split("\n"))
    sys.stderr.write(prefixed)
    sys.stderr.write(f"[rank {rank}] mpidomain: uncaught exception, aborting all ranks "
                     "(set MPIDOMAIN_ABORT_ON_ERROR=0 to disable)\n")
    sys.stderr.flush()
    if world.Get_size() > 1:
        # Give the launcher a moment to forward the traceback before it tears the job down.
        time.sleep(_FORWARD_SECONDS)
        world.Abort(1)


def install_abort_on_error():
    """Install a ``sys.excepthook`` that aborts every rank on an uncaught exception.

    Local to the calling rank; installing twice is harmless.
    """
    global _previous_hook
    if sys.excepthook is not _abort_hook:
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_hook

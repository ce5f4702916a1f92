"""What every ``python -m mpidomain`` command shares: its checks, and how it ends on every rank.

A command runs on every rank of the job. :func:`run_command` turns its end
into an exit status the same way for all of them:

- an error every rank raised alike (a bad argument, config key or input,
  settled by an agreement step, or a :class:`UsageError`): one line from rank
  0, ``python -m mpidomain <command>: error: <message>``, exit status 2
  (1 for a failure of the run rather than of its inputs);
- an exception on some ranks only (a training step, a write, the plot, one
  rank's disk): that rank prints ``error on rank R`` with its message, and the
  whole job is aborted at once (exit status 1), never left waiting for the
  other ranks' ``MPIDOMAIN_TIMEOUT``.

Before any rank works, :func:`require` imports what the command needs on
every rank and :func:`agreed` settles every check whose outcome a rank
decides alone (a file it reads, a folder it writes), so that a mistake is one
line on every rank instead of a traceback or a hang.
"""

import importlib
import itertools
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

from ._agreement import agree
from ._errors import describe_error, raised_alike, raised_alike_on
from ._mpi import mpi
from ._validate import RNG_MODES

__all__ = ["Requirement", "UsageError", "add_rng_option", "agreed", "decided", "positive_int", "probe_writable",
           "require", "run_command", "world"]

#: How long a rank whose command failed, with no agreement step settling it, waits for the other ranks to fail too
#: before it aborts the job (seconds); longer for a :class:`UsageError`, which every rank raises from the same inputs.
ALONE_SECONDS = 3.0
USAGE_SECONDS = 30.0
_USAGE_KINDS = (ValueError, TypeError, KeyError, OSError, ImportError)
_WORLD = []


class UsageError(ValueError):
    """A mistake in a command's arguments, config or inputs, raised alike on every rank: one line, exit status 2."""


@dataclass(frozen=True)
class Requirement:
    """A package a command needs: ``module`` (the import name), what ``needed_for``, the ``install`` line, and
    the ``minimum`` version (its ``__version__``) where an older one does not do."""

    module: str
    needed_for: str
    install: str
    minimum: Optional[str] = None


def _release(text):
    """The leading numbers of a version: "3.1.5rc1" -> (3, 1, 5)."""
    numbers = []
    for part in str(text).split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) < len(part):
            break
    return tuple(numbers)


def world():
    """Return the command layer's own duplicate of ``MPI.COMM_WORLD``.

    Collective the first time (every rank of the job calls it at the same point: :func:`run_command` does,
    before the command starts); later calls return the same communicator, locally.
    """
    if not _WORLD:
        comm = mpi().COMM_WORLD.Dup()
        comm.Set_name("the job's ranks (the command layer)")
        _WORLD.append(comm)
    return _WORLD[0]


def _usage(error):
    """``error`` (one of the kinds a check raises) as the :class:`UsageError` every rank raises."""
    if isinstance(error, UsageError):
        return error
    return UsageError(str(error) if isinstance(error, (ValueError, TypeError)) else describe_error(error))


def require(command, requirements, *, optional=()):
    """Import every module of ``requirements`` and ``optional`` on every rank; raise if one is missing anywhere.

    Collective over the job's ranks: call on every rank with the same arguments, before the command does any work.
    A required module that fails to import on some rank (ImportError, or any exception at import such as a
    CUDA-built package beside a CPU torch) raises :class:`UsageError` alike on every rank, naming the package, what
    needs it and the line that installs it. ``optional`` modules (comfort only, such as a progress bar) never
    raise: return the set of their names that are missing on any rank (the same set on every rank).
    """
    comm = world()
    missing, installs = {}, {}
    for requirement in (*requirements, *optional):
        if requirement.module in missing:
            continue
        try:
            module = importlib.import_module(requirement.module)
        except Exception as error:  # noqa: BLE001 - a broken install raises what it raises
            missing[requirement.module] = f"does not import here ({describe_error(error)})"
            needs = _missing_dependency(error, requirement.module)
            if needs is not None:  # the package is there, a package it imports is not: install that one
                missing[requirement.module] = f"does not import here: it needs {needs} ({describe_error(error)})"
                installs[requirement.module] = f"pip install {_PIP_NAMES.get(needs, needs)}"
            continue
        found = getattr(module, "__version__", None)
        if requirement.minimum and found is not None and _release(found) < _release(requirement.minimum):
            missing[requirement.module] = f"is too old here (version {found}; {requirement.minimum} or newer needed)"
    error = None
    for requirement in requirements:
        if requirement.module in missing:
            error = UsageError(f"{requirement.module} is needed for {requirement.needed_for} but "
                               f"{missing[requirement.module]}; install it: "
                               f"{installs.get(requirement.module, requirement.install)}")
            break
    agree(comm, f"{command}: checking the installed packages", None, error=error)
    names = {requirement.module for requirement in optional}
    everywhere = set().union(*comm.allgather(sorted(names & set(missing))))
    return everywhere


# Import names whose package on PyPI is named otherwise.
_PIP_NAMES = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn"}


def _missing_dependency(error, module):
    """The top-level module whose absence made ``module``'s import fail, if it is another one; else None."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    top = name.partition(".")[0] if name else None
    return top if top and top != module.partition(".")[0] else None


def agreed(comm, call, work):
    """Run ``work()`` on every rank of ``comm`` and return its result; if it failed on any rank, raise on all.

    Collective over ``comm``: call on every rank with the same ``call``. For a check whose outcome each rank
    decides alone (a file it reads, a folder it writes to): a ValueError, TypeError, KeyError, OSError or
    ImportError on any rank becomes the same error on every rank (a :class:`UsageError` where every rank had the
    same message, else a ValueError listing each failing rank's message). Other exceptions propagate as they are.
    """
    result = error = None
    try:
        result = work()
    except _USAGE_KINDS as exc:
        error = _usage(exc)
    agree(comm, call, None, error=error)
    return result


def decided(comm, call, work, root=0):
    """Run ``work()`` on ``root`` only (a check one rank makes for all: a folder it creates, a file it probes);
    if it failed there, raise the same :class:`UsageError`, with its message, on every rank of ``comm``.

    Collective over ``comm``. ``work`` raising ValueError, TypeError, KeyError, OSError or ImportError fails the
    check; other exceptions propagate on ``root`` (and end the job there). Returns ``work()``'s result on
    ``root``, None elsewhere.
    """
    result = message = None
    if comm.Get_rank() == root:
        try:
            result = work()
        except _USAGE_KINDS as exc:
            message = str(_usage(exc))
    if agree(comm, call, None, flag=message is not None):
        raise raised_alike(UsageError(comm.bcast(message, root=root)), comm)
    return result


def _one_line(command, message):
    text = "; ".join(line.strip() for line in str(message).strip().splitlines() if line.strip()).replace(":;", ":")
    return f"python -m mpidomain {command}: error: {text}"


def _status(error):
    return 2 if isinstance(error, _USAGE_KINDS) else 1


def _failed_alone(command, comm, error, claimed):
    """This rank's command raised ``error``, not settled by an agreement over every rank: if the other ranks
    raise too (``claimed``: a :class:`UsageError` of a check every rank makes), report once; else end the job."""
    request = comm.Ibarrier()  # every rank that failed alike (a check no agreement settled) meets here
    deadline = time.monotonic() + (USAGE_SECONDS if claimed else ALONE_SECONDS)
    while not request.Test():
        if time.monotonic() > deadline:
            _abort(command, comm, error)
        time.sleep(0.01)
    reports = comm.allgather((_status(error), str(error) if isinstance(error, _USAGE_KINDS) else describe_error(error)))
    if comm.Get_rank() == 0:
        messages = sorted({message for _, message in reports})
        print(_one_line(command, messages[0] if len(messages) == 1 else "; ".join(messages)), file=sys.stderr,
              flush=True)
    return max(status for status, _ in reports)


def _abort(command, comm, error):
    rank = comm.Get_rank()
    lines = [f"python -m mpidomain {command}: error on rank {rank}: {describe_error(error)}"]
    if not isinstance(error, _USAGE_KINDS):  # not a mistake in the inputs: the traceback says where
        lines[:0] = [f"[rank {rank}] {line}" for line in
                     "".join(traceback.format_exception(type(error), error, error.__traceback__)).rstrip().split("\n")]
    lines.append(f"python -m mpidomain {command}: ending the job on every rank (rank {rank} failed alone)")
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()
    time.sleep(0.2)  # let the launcher forward the message before it tears the job down
    mpi().COMM_WORLD.Abort(1)


def run_command(command, work):
    """Run ``work()``, the command ``python -m mpidomain <command>``, on every rank; return its exit status.

    Collective over the job's ranks. ``work`` returns the exit status (None: 0). An error raised alike on every
    rank prints one line from rank 0 and returns 2 (1 for a failure of the run rather than of its inputs, such as
    a timed-out wait); an exception on some ranks only ends the job on every rank at once (``MPI_Abort``, exit
    status 1) after that rank printed its message. KeyboardInterrupt and SystemExit pass through.
    """
    comm = world()
    try:
        status = work()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as error:  # noqa: BLE001 - every failure ends the command
        ranks = raised_alike_on(error)
        if ranks in (-1, comm.Get_size()):  # every rank of the job raised it
            if comm.Get_rank() == 0:
                print(_one_line(command, error), file=sys.stderr, flush=True)
            return _status(error)
        return _failed_alone(command, comm, error, claimed=ranks == 0 and isinstance(error, UsageError))
    return 0 if status is None else status


def add_rng_option(parser):
    """Add ``--rng tile|one-process`` (how the converted model's random layers draw) to ``parser``."""
    parser.add_argument("--rng", choices=RNG_MODES, default="tile",
                        help="how dropout inside the converted model draws: tile (default), each rank its tile's "
                             "mask from its own stream, seeded from the seed and its place, reproducible at a "
                             "fixed layout; one-process, bitwise the masks one process draws, at any layout (each "
                             "dropout draws the whole field's mask: one process's activation of that layer, "
                             "transient, and the time to draw it)")


def positive_int(text):
    """Parse a command-line integer >= 1 (an ``argparse`` type: a bad value is one line, exit status 2)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def probe_writable(folder):
    """Create and remove a file in the existing ``folder``; raise OSError where it cannot be written. Local: call
    it inside :func:`agreed` or :func:`decided`. The file's name holds the host and process, so ranks of several
    nodes may probe one shared folder at once."""
    probe = os.path.join(folder, f".mpidomain-write-test-{socket.gethostname()}-{os.getpid()}")
    with open(probe, "wb") as file:
        file.write(b"ok")
    os.remove(probe)

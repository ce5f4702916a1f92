"""Waits with a deadline: every wait of the library gives up after ``MPIDOMAIN_TIMEOUT``.

A rank that skipped a call (or ended, or is stuck elsewhere) would leave the
others waiting forever; these waits turn that hang into a RuntimeError naming
the call, the group and what is still outstanding, and mark the group out of
step (:data:`TIMED_OUT`), so later agreements on it raise at once. They poll
without holding the core (ranks may outnumber cores). Above ``_mpi.py`` only.
"""

import os
import time

import numpy as np

from . import comm_stats
from ._mpi import mpi

TIMED_OUT = set()  # handles of the library communicators whose agreement timed out


def forget_timeout(comm):
    """Drop ``comm`` from the timed-out communicators (it is being freed; its handle may be reused)."""
    TIMED_OUT.discard(comm.py2f())


def timeout_seconds():
    """Return how long an agreement waits for the other ranks (``MPIDOMAIN_TIMEOUT``, default 600 s), or None.

    ``MPIDOMAIN_TIMEOUT=0`` (or ``none``) waits forever. Set it alike on every rank.
    """
    setting = os.environ.get("MPIDOMAIN_TIMEOUT", "600").strip().lower()
    if setting in ("0", "none", "off", ""):
        return None
    try:
        seconds = float(setting)
    except ValueError:
        raise ValueError(f"MPIDOMAIN_TIMEOUT must be a number of seconds (0: no limit), got {setting!r}") from None
    if seconds < 0:
        raise ValueError(f"MPIDOMAIN_TIMEOUT must be >= 0 seconds (0: no limit), got {setting!r}")
    return seconds


def group_name(comm):
    """Return how messages name ``comm``'s group: the name the manager gave it, else its size."""
    return comm.Get_name() or f"a group of {comm.Get_size()} ranks"


def wait_with_deadline(comm, request, call):
    """Complete ``request`` of an agreement on ``comm``, or raise RuntimeError after :func:`timeout_seconds`.

    A rank that skipped ``call`` (or ended) leaves the others waiting here: the
    deadline turns that hang into an error on every waiting rank (and, with the
    abort-on-error hook, the end of the job).
    """
    wait_requests([request], comm, call, None, sleep=True)


SLEEPING_WAIT_BYTES = 1 << 16  # collectives up to this size wait sleeping; larger ones poll


def wait_collective(request, comm, call, nbytes):
    """Complete the non-blocking collective ``request`` on ``comm`` moving ``nbytes`` per rank; bounded.

    A small one (up to :data:`SLEEPING_WAIT_BYTES`) is done in microseconds once every rank has
    arrived, so a waiting rank sleeps between polls once the wait lasts 1 ms, leaving the cores to
    the ranks it waits for (a blocking collective's busy poll holds them where ranks outnumber
    cores). A larger one moves only while the ranks poll (no progress thread), so it polls and
    yields. Either way it raises RuntimeError after :func:`timeout_seconds`.
    """
    wait_requests([request], comm, call, None, sleep=nbytes <= SLEEPING_WAIT_BYTES)


def allgather_ints(comm, values, call):
    """Return every rank's ``values`` (a tuple of ints, as long on every rank), one row per rank; collective.

    One non-blocking Allgather, completed by :func:`wait_collective` (bounded; a
    blocking collective's busy poll would hold the cores the ranks it waits for need).
    """
    mine = np.asarray(values, dtype=np.int64)
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    if comm_stats.recorder is not None and comm.Get_size() > 1:
        comm_stats.sent("control", mine.nbytes)
    wait_collective(comm.Iallgather(mine, everyone), comm, call, everyone.nbytes)
    return [tuple(int(v) for v in row) for row in everyone]


def barrier(comm, call):
    """Wait for every rank of ``comm`` (a non-blocking barrier, bounded by :func:`timeout_seconds`); collective."""
    wait_all([comm.Ibarrier()], comm=comm, call=call)


def wait_all(requests, *, comm=None, call="a wait", awaiting=None):
    """Complete every request, or raise RuntimeError after :func:`timeout_seconds` (``MPIDOMAIN_TIMEOUT``).

    Like ``MPI.Request.Waitall``, but bounded, and without its busy poll
    holding the core: where ranks outnumber cores (a laptop's
    ``mpiexec -n 4``), the rank being waited for may need that very core.
    Spins briefly, then yields between polls. On expiry the error
    names ``call``, ``comm``'s group and, from ``awaiting`` (one description
    per request, or a function returning them, called only then), what is
    still outstanding; ``comm`` is then out of step, and later agreements on
    it raise at once.
    """
    wait_requests(requests, comm, call, awaiting, sleep=False)


def wait_requests(requests, comm, call, awaiting, sleep, statuses=None, enough=None):
    """Poll ``requests`` until done (return True) or past the deadline; ``sleep``: also sleep between polls after 1 ms.

    ``statuses``, if given, receive the requests' statuses as they complete. ``enough``, one of
    ``requests``: once it is complete (left for its owner to complete again), stop and return False.
    With a :class:`~mpidomain.comm_stats.WaitTimer` open, the seconds spent here are added to it.
    """
    if comm_stats.timer is not None:
        began = comm_stats.clock()
        try:
            return _poll(requests, comm, call, awaiting, sleep, statuses, enough)
        finally:
            comm_stats.waited(comm_stats.clock() - began)
    return _poll(requests, comm, call, awaiting, sleep, statuses, enough)


def _poll(requests, comm, call, awaiting, sleep, statuses, enough):
    """:func:`wait_requests`' poll, untimed."""
    testall = mpi().Request.Testall
    if testall(requests, statuses):
        return True
    start = time.monotonic()
    pause, limit = 0.0, False  # the setting is read once a wait lasts 1 ms, not on the fast path
    while not testall(requests, statuses):
        if enough is not None and enough.Get_status():
            return False
        waited = time.monotonic() - start
        yield_core(waited)
        if waited > 0.001:
            if limit is False:
                limit = timeout_seconds()
            if limit is not None and waited > limit:
                raise timeout_error(requests, comm, call, awaiting, waited, limit)
            if sleep:
                pause = min(0.01, pause + 0.0001)
                time.sleep(pause)
    return True


def timeout_error(requests, comm, call, awaiting, waited, limit):
    """The RuntimeError of a wait past its deadline; marks ``comm`` out of step."""
    where = "this rank"
    if comm is not None:
        TIMED_OUT.add(comm.py2f())
        where = f"rank {comm.Get_rank()} of {group_name(comm)}"
    if callable(awaiting):
        awaiting = awaiting()
    outstanding = ""
    if awaiting is not None:
        # Get_status completes nothing: a request Testall left pending is still pending.
        pending = [what for request, what in zip(requests, awaiting) if not request.Get_status()]
        outstanding = f", still awaiting {'; '.join(pending)}" if pending else ""
    return RuntimeError(
        f"{call}: {where} waited {waited:.0f} s for the other ranks (MPIDOMAIN_TIMEOUT={limit:g}){outstanding}; "
        "a rank skipped this call, ended, or is stuck in something else. Every rank must make the same mpidomain "
        "calls in the same order: look for a call only some ranks make (under an if on the rank, or skipped by an "
        "exception); raise MPIDOMAIN_TIMEOUT if some ranks legitimately arrive this much later"
    )


def yield_core(waited):
    """After a short spin, give the core to any other runnable process (a no-op when none is)."""
    if waited > 20e-6:
        os.sched_yield()

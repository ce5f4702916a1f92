"""The agreement step: every entry point that communicates starts by settling the call on every rank.

:func:`agree` is the package's one collective check: a local mistake on any
rank, ranks in different calls, using different managers (through
``_routing.py``'s shared communicators) or passing different arguments raise
alike on every rank; :func:`must_match` words the "must be the same on every
rank" error for a value that must match. It costs one non-blocking Allreduce
of a few integers when the ranks agree. :class:`Agreement` is the same in two
halves, restartable, for the halo exchange's cache-hit path. Messages a call
started ahead of its agreement (:class:`AheadMessages`) are settled on every
rank when it fails. The top of the collective helpers: it uses ``_waits.py``,
``_errors.py`` and ``_routing.py``.
"""

import time

import numpy as np

from . import comm_stats
from ._errors import digest, error_report, raise_reported, raised_alike, rank_ranges
from ._mpi import mpi
from ._routing import route, routed_comm
from ._waits import TIMED_OUT, group_name, timeout_error, timeout_seconds, wait_requests, wait_with_deadline, yield_core

_VALUES = {}  # (code, flag, token, ahead) -> an agreement's values, copied for each use (a call repeats them)


def _agreement_values(flag, token, code, ahead):
    """Return the int64 array of what one rank brings to an agreement (MAX-reduced: negated twins give the minimum);
    shared: copy it before the reduction writes to it."""
    key = (code, flag, token, ahead)
    values = _VALUES.get(key)
    if values is None:
        if len(_VALUES) >= 1024:
            _VALUES.clear()
        values = _VALUES[key] = np.array([code, -code, int(flag), token, -token, int(ahead), -int(ahead)], dtype=np.int64)
    return values


def _agreement_result(values):
    return int(values[0]) == -int(values[1]), bool(values[2]) or int(values[3]) != -int(values[4])


def agreement_code(call, description):
    """Return the digest :func:`agree` compares for ``call`` with ``description`` and no local error."""
    return digest((call, description, None))


class Agreement:
    """:func:`agree` in two halves: started here (non-blocking), settled by :meth:`result`.

    Collective like :func:`agree`, with the same arguments; local work may
    run between the halves, overlapping the agreement's latency. With
    ``start=False`` it is only prepared: each :meth:`start` then begins the
    same agreement again (a call made again and again prepares it once).

    ``ahead`` (:class:`AheadMessages`, optional) are the messages of the call
    itself on ``comm``, which the caller would start before the result: if ``self.ahead``
    is True it must start them at once. :meth:`result` then returns False (go
    on: finish them) only if every rank agreed and went ahead alike; in every
    other case it first settles all ranks' started messages (each receive
    cancelled or completed, each message sent drained by its destination), so
    none is left to match a later receive, and then raises or returns True
    (the messages are gone; build anew).
    """

    def __init__(self, comm, call, description, flag=False, error=None, mismatch=None, token=0, code=None,
                 ahead=None, start=True):
        # Through the communicator the library comms of this membership share: there, a rank using
        # another manager (another owner) in this call meets this one instead of waiting elsewhere.
        handle = comm.py2f()
        comm, self._owner, mark = route(comm)
        self._handles = {handle, comm.py2f()}
        self._comm, self._call, self._description = comm, call, description
        self._error, self._mismatch = error, mismatch
        local = None if error is None else f"{type(error).__name__}: {error}"
        if code is None or error is not None:
            code = digest((call, description, local))
        # Messages on ``comm`` the caller may start before the result: only where the ranks that could be sent
        # them meet in this agreement (a shared route), so that a failure can settle them.
        self._ahead = (ahead, self._owner) if ahead is not None and error is None and self._owner is not None else None
        self.ahead = self._ahead is not None
        self._template = _agreement_values(bool(flag), token, code ^ mark, self.ahead)
        self._values = self._request = None
        MPI = mpi()
        self._in_place, self._max = MPI.IN_PLACE, MPI.MAX
        self._unchanged = False  # whether _values still equal _template (after an agreement that went through)
        if start:
            self.start()

    def start(self):
        """Begin the agreement (again, if prepared); return its request."""
        if TIMED_OUT and not TIMED_OUT.isdisjoint(self._handles):
            raise RuntimeError(
                f"{self._call}: an earlier mpidomain call on this group timed out waiting for the other ranks, so "
                "the group's ranks are no longer in step; end the job (and fix the call only some ranks made)"
            )
        values = self._values
        if not self._unchanged:
            values = self._values = self._template.copy()
        self._unchanged = False
        if comm_stats.recorder is not None and self._comm.Get_size() > 1:
            comm_stats.sent("control", values.nbytes)
        self._request = request = self._comm.Iallreduce(self._in_place, values, op=self._max)
        return request

    def wait(self):
        """Complete the agreement, polling the messages started ahead with it; return True if they completed too."""
        # The messages may never complete if the ranks are not in step: the agreement's completion ends the poll.
        ahead = self._ahead[0].requests if self._ahead is not None else None
        if not ahead:
            wait_with_deadline(self._comm, self._request, self._call)
            return False
        if wait_requests([self._request, *ahead], self._comm, self._call, None, True, None, self._request):
            return True
        self._request.Wait()  # complete (its status says so): this frees it
        return False

    def went_through(self):
        """After :meth:`wait`: True if every rank agreed, no flag was set and (if this rank went ahead) all went ahead."""
        code, negated, flag, token, negated_token, ahead, all_ahead = self._values.tolist()
        # If so, every rank brought the same values, so the reduction left them as they were: reusable.
        self._unchanged = code == -negated and not flag and token == -negated_token and (not ahead or all_ahead == -1)
        return self._unchanged

    def result(self):
        """Wait for the agreement; return the flag set on any rank (or tokens unequal), or raise on every rank."""
        return self.conclude(self.wait())

    def conclude(self, completed):
        """After :meth:`wait` (``completed``: what it returned): :meth:`result`'s answer."""
        values = self._values
        same, any_flag = _agreement_result(values)
        went_ahead, all_went_ahead = bool(values[5]), int(values[6]) == -1
        if went_ahead and not (same and not any_flag and all_went_ahead):
            _settle_ahead(self._comm, self._ahead, self._call, completed)
            any_flag = True  # the messages are gone: a caller that went ahead must not finish them
        comm, call, description, error = self._comm, self._call, self._description, self._error
        if same:
            if error is not None:
                raise raised_alike(error, comm)
            return any_flag
        everyone = comm.allgather((call, description, error_report(error), self._owner))
        owners = {}
        for rank, (c, _, _, owner) in enumerate(everyone):
            owners.setdefault(owner, []).append(rank)
        if len(owners) > 1:
            listing = ", ".join(f"{owner} on rank{'s' * (len(r) > 1)} {rank_ranges(r)}" for owner, r in owners.items())
            raise raised_alike(RuntimeError(
                f"{call}: the ranks of {group_name(comm)} use different managers in the same mpidomain call "
                f"({listing}); every rank must use its managers in the same order: look for managers picked "
                "by rank (or in an order that differs across ranks)"
            ), comm)
        everyone = [e[:3] for e in everyone]
        calls = [c for c, _, _ in everyone]
        if len(set(calls)) > 1:
            listing = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            raise raised_alike(RuntimeError(
                f"the ranks of one group are in different mpidomain calls ({listing}); every rank must make the "
                "same collective calls in the same order: look for a call only some ranks make (under an if on "
                "the rank, or skipped by an exception)"
            ), comm)
        raise_reported([report for _, _, report in everyone], error, comm)  # the local errors first, alike everywhere
        descriptions = [d for _, d, _ in everyone]
        if self._mismatch is not None:
            raise raised_alike(self._mismatch(descriptions), comm)
        listing = ", ".join(f"rank {r}: {d!r}" for r, d in enumerate(descriptions))
        raise raised_alike(ValueError(f"{call} needs the same arguments on every rank, got {listing}"), comm)


class AheadMessages:
    """Messages a call started on its :class:`Agreement`'s communicator before the agreement settled.

    ``sends`` and ``receives``: lists of ``(peer, tag, request)``, the started
    requests; ``requests``: the same requests in one list. The caller fills
    them in once it started them.
    """

    def __init__(self):
        self.sends, self.receives, self.requests = [], [], []


def _settle_ahead(comm, ahead, call, completed=False):
    """Finish or undo every rank's messages started ahead of a failed agreement on ``comm``; collective over ``comm``.

    Each rank cancels its started receives (a receive already matched completes instead), then
    receives and drops every message another rank sent it that none of its receives took, then
    completes its sends. ``completed``: this rank's messages are all complete already (nothing
    to cancel). Every wait is bounded by :func:`timeout_seconds`.
    """
    MPI = mpi()
    messages, name = ahead if ahead is not None else (None, None)
    sent = [] if messages is None else [(peer, tag) for peer, tag, _ in messages.sends]
    everyone = comm.allgather(None if messages is None else (name, sent))
    taken = set()
    if messages is not None and completed:
        taken = {(name, peer, tag) for peer, tag, _ in messages.receives}
    elif messages is not None:
        receives = messages.receives
        for _, _, request in receives:
            request.Cancel()
        statuses = [MPI.Status() for _ in receives]
        wait_requests([request for _, _, request in receives], comm, call, None, sleep=False, statuses=statuses)
        for (peer, tag, request), status in zip(receives, statuses):
            if not status.Is_cancelled():
                taken.add((name, peer, tag))
    me = comm.Get_rank()
    for peer, record in enumerate(everyone):
        if record is None:
            continue
        sender_name, sends = record
        for destination, tag in sends:
            if destination == me and (sender_name, peer, tag) not in taken:
                _drop_message(routed_comm(comm, sender_name), peer, tag, call)
    if messages is not None and not completed:
        wait_requests([request for _, _, request in messages.sends], comm, call, None, sleep=False)


def _drop_message(comm, source, tag, call):
    """Receive and discard the message from ``source`` with ``tag`` on ``comm``, waiting at most the deadline."""
    MPI = mpi()
    status = MPI.Status()
    start, limit = time.monotonic(), timeout_seconds()
    while True:
        message = comm.improbe(source=source, tag=tag, status=status)
        if message is not None:
            break
        waited = time.monotonic() - start
        if limit is not None and waited > limit:
            raise timeout_error([], comm, call, None, waited, limit)
        yield_core(waited)
    message.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])


def agree(comm, call, description, flag=False, error=None, mismatch=None, token=0, code=None):
    """Settle one collective call on every rank of ``comm``: return ``flag`` set on any rank, or raise on all.

    The package's one collective check. Collective: every entry point that
    communicates starts with it, so a rank that skipped or reordered a call
    meets the others here; a later step of a call that can fail on some ranks
    only (``description`` None, ``error`` the local failure) ends with it too.
    Costs one Allreduce of seven integers when the ranks agree, bounded by
    :func:`timeout_seconds`. ``call`` names the entry point, ``description``
    what this rank passed (picklable, compared by its ``repr``), ``error``
    this rank's local problem or None. Otherwise every rank raises:
    RuntimeError if the ranks are in different calls; the local errors
    (the lowest failing rank's type, unless every rank raised the same error:
    then that one; a message listing each failing rank's error); else
    ``mismatch(descriptions)`` (one per rank) returns the exception, default a
    ValueError listing them (:func:`must_match` words one for a value).
    Ranks passing different int ``token`` values also return True: e.g. a
    cache hit on every rank, but on plans that were not built together.
    ``code``, for a call made again and again, is
    ``agreement_code(call, description)`` kept from an earlier call.
    :class:`Agreement` is the same in two halves.
    """
    return Agreement(comm, call, description, flag, error, mismatch, token, code).result()


def must_match(what, fix=""):
    """Return the ``mismatch`` for :func:`agree` on a value that must match: a ValueError naming ``what`` and ``fix``.

    ``"{what} must be the same on every rank, got rank 0: ..., rank 1: .... {fix}"``.
    """
    def mismatch(values):
        listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
        return ValueError(f"{what} must be the same on every rank, got {listing}. {fix}".rstrip())
    return mismatch

"""Lazy access to mpi4py and the collective error helpers every module uses.

Importing this module does not start MPI: ``mpi()`` imports ``mpi4py.MPI``
(which initialises the library) at the first call that needs it.
"""

import hashlib
import os
import time

import numpy as np

_MPI = None


def mpi():
    """Return the ``mpi4py.MPI`` module, initialising MPI on first use."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI

        _MPI = MPI
    return _MPI


def is_active():
    """Return True while MPI is initialised and not yet finalised."""
    if _MPI is None:
        return False
    return _MPI.Is_initialized() and not _MPI.Is_finalized()


def raise_on_all_ranks(comm, error, call=None):
    """Raise on every rank of ``comm`` if ``error`` is set on any rank.

    Collective: call on all ranks of ``comm``; pass ``None`` where the local
    checks passed. Every rank raises the same exception type (that of the
    lowest failing rank) with a message listing each failing rank's error, so
    a mistake only one rank can see never leaves the others waiting. Waits
    for the other ranks at most :func:`timeout_seconds`; ``call`` names the
    entry point in that error.
    """
    fence(comm, call or "an error check")
    raise_reported(comm.allgather(error_report(error)), error)


def fence(comm, call):
    """Wait until every rank of ``comm`` reached ``call``, at most :func:`timeout_seconds`, else raise RuntimeError.

    Collective: one non-blocking barrier. Put it before a blocking
    collective that starts an entry point (no agreement step before it), so
    a rank that skipped the call cannot leave the others in it forever.
    """
    wait_with_deadline(comm, comm.Ibarrier(), call)


def error_report(error):
    """Return what :func:`raise_reported` needs of this rank's ``error`` (None if none), to gather."""
    return None if error is None else (type(error).__name__, str(error))


def raise_reported(reports, error=None):
    """Raise, alike on every rank, if any rank's gathered :func:`error_report` holds an error.

    ``reports`` is every rank's report, in rank order; ``error`` this rank's own.
    """
    failed = [(rank, report) for rank, report in enumerate(reports) if report]
    if not failed:
        return
    kinds = {"ValueError": ValueError, "TypeError": TypeError, "NotImplementedError": NotImplementedError}
    by_message = {}
    for rank, (_, message) in failed:
        by_message.setdefault(message, []).append(rank)
    if error is not None and len(by_message) == 1 and len(failed) == len(reports):
        raise error
    kind = kinds.get(failed[0][1][0], RuntimeError)
    lines = [f"rank{'s' * (len(r) > 1)} {_ranges(r)}: {m}" for m, r in by_message.items()]
    raise kind(
        f"{len(failed)} of {len(reports)} ranks rejected the call:\n  " + "\n  ".join(lines)
    )


def _ranges(ranks):
    """Format sorted ranks compactly: [0, 1, 2, 5] -> '0-2,5'."""
    spans = [[ranks[0], ranks[0]]]
    for rank in ranks[1:]:
        if rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

def check_same(comm, value, what, fix="", error=None, call=None):
    """Raise ValueError on every rank unless all ranks passed the same ``value``.

    Collective: call on all ranks of ``comm``: a :func:`fence` (``call`` names
    the entry point), then one allgather. The message lists
    what each rank had; ``what`` names the argument and ``fix`` says how to
    mend it. An ``error`` found locally on any rank is raised first, as
    :func:`raise_on_all_ranks` raises it, in the same step.
    """
    fence(comm, call or f"the check of {what}")
    gathered = comm.allgather((error_report(error), value if error is None else None))
    raise_reported([report for report, _ in gathered], error)
    values = [v for _, v in gathered]
    if all(v == values[0] for v in values):
        return values[0]
    listing = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
    raise ValueError(f"{what} must be the same on every rank, got {listing}. {fix}".rstrip())


def digest(value):
    """Return a 62-bit digest of ``repr(value)``: what :func:`agree` compares across ranks."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


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
        shared, self._owner, mark = _ROUTES.get(handle, ([comm], None, 0))
        comm = shared[0]
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
        mpi()  # MPI is up: start() reads the module directly
        self._unchanged = False  # whether _values still equal _template (after an agreement that went through)
        if start:
            self.start()

    def start(self):
        """Begin the agreement (again, if prepared); return its request."""
        if _TIMED_OUT and not _TIMED_OUT.isdisjoint(self._handles):
            raise RuntimeError(
                f"{self._call}: an earlier mpidomain call on this group timed out waiting for the other ranks, so "
                "the group's ranks are no longer in step; end the job (and fix the call only some ranks made)"
            )
        values = self._values
        if not self._unchanged:
            values = self._values = self._template.copy()
        self._unchanged = False
        self._request = request = self._comm.Iallreduce(_MPI.IN_PLACE, values, op=_MPI.MAX)  # mpi() ran: __init__
        return request

    def wait(self):
        """Complete the agreement, polling the messages started ahead with it; return True if they completed too."""
        # The messages may never complete if the ranks are not in step: the agreement's completion ends the poll.
        ahead = self._ahead[0].requests if self._ahead is not None else None
        if not ahead:
            wait_with_deadline(self._comm, self._request, self._call)
            return False
        if _wait([self._request, *ahead], self._comm, self._call, None, True, None, self._request):
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
                raise error
            return any_flag
        everyone = comm.allgather((call, description, error is not None, self._owner))
        owners = {}
        for rank, (c, _, _, owner) in enumerate(everyone):
            owners.setdefault(owner, []).append(rank)
        if len(owners) > 1:
            listing = ", ".join(f"{owner} on rank{'s' * (len(r) > 1)} {_ranges(r)}" for owner, r in owners.items())
            raise RuntimeError(
                f"{call}: the ranks of {group_name(comm)} use different managers in the same mpidomain call "
                f"({listing}); every rank must use its managers in the same order: look for managers picked "
                "by rank (or in an order that differs across ranks)"
            )
        everyone = [e[:3] for e in everyone]
        calls = [c for c, _, _ in everyone]
        if len(set(calls)) > 1:
            listing = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            raise RuntimeError(
                f"the ranks of one group are in different mpidomain calls ({listing}); every rank must make the "
                "same collective calls in the same order: look for a call only some ranks make (under an if on "
                "the rank, or skipped by an exception)"
            )
        if any(failed for _, _, failed in everyone):
            raise_on_all_ranks(comm, error)
        descriptions = [d for _, d, _ in everyone]
        if self._mismatch is not None:
            raise self._mismatch(descriptions)
        listing = ", ".join(f"rank {r}: {d!r}" for r, d in enumerate(descriptions))
        raise ValueError(f"{call} needs the same arguments on every rank, got {listing}")


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
        _wait([request for _, _, request in receives], comm, call, None, sleep=False, statuses=statuses)
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
                _drop_message(_routed_comm(comm, sender_name), peer, tag, call)
    if messages is not None and not completed:
        _wait([request for _, _, request in messages.sends], comm, call, None, sleep=False)


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
            raise _timed_out([], comm, call, None, waited, limit)
        _yield_core(waited)
    message.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE])


def _routed_comm(shared, name):
    """The communicator named ``name`` whose agreements route through ``shared`` (this rank's handle of it)."""
    for handle, (entry, owner, _) in _ROUTES.items():
        if entry[0] is shared and owner == name:
            return entry[3][handle]
    raise RuntimeError(f"no communicator of {name} routes its agreements through {group_name(shared)}")


def agree(comm, call, description, flag=False, error=None, mismatch=None, token=0, code=None):
    """Settle one collective call on every rank of ``comm``: return ``flag`` set on any rank, or raise on all.

    Collective: every entry point that communicates starts with it, so a
    rank that skipped or reordered a call meets the others here. Costs one
    Allreduce of five integers when the ranks agree. ``call`` names the
    entry point, ``description`` what this rank passed (picklable, compared
    with ==), ``error`` this rank's local problem or None. Otherwise every
    rank raises: RuntimeError if the ranks are in different calls; the local
    errors as :func:`raise_on_all_ranks` does; else ``mismatch(descriptions)``
    (one per rank) returns the exception, default a ValueError listing them.
    Ranks passing different int ``token`` values also return True: e.g. a
    cache hit on every rank, but on plans that were not built together.
    ``code``, for a call made again and again, is
    ``agreement_code(call, description)`` kept from an earlier call.
    :class:`Agreement` is the same in two halves.
    """
    return Agreement(comm, call, description, flag, error, mismatch, token, code).result()


_TIMED_OUT = set()  # handles of the library communicators whose agreement timed out


def forget_timeout(comm):
    """Drop ``comm`` from the timed-out communicators (it is being freed; its handle may be reused)."""
    _TIMED_OUT.discard(comm.py2f())


_ROUTES = {}  # handle of a library communicator -> (its shared entry, owner's name, digest of the name)
_SHARED = {}  # membership (world ranks in rank order) -> [agreement communicator, live comms routed there, membership,
#              {handle: comm} of those comms]
_OWNERS = [0]  # owners numbered so far, agreed on by the ranks that made each


def share_agreements(anchor, comms, label):
    """Route the agreements of ``comms`` through communicators shared with others of the same members; return the owner's number.

    Collective over ``anchor``, whose ranks must hold all of ``comms`` (each
    collective over its own ranks, passed in the same order everywhere).
    ``comms`` (say, one manager's private communicators) get an owner number
    agreed across ``anchor`` (one more than any owner any of its ranks
    numbered before) and the name ``label.format(number=...)``. Every
    :func:`agree` on one of them travels through one communicator per
    membership (world ranks in rank order), the same for all live owners'
    comms of that membership, with the owner in its digest: ranks of one
    group using different owners in the same call meet there and raise,
    naming the owners, instead of waiting on two communicators until the
    timeout. Release with :func:`unshare_agreements`.
    """
    MPI = mpi()
    world = MPI.COMM_WORLD.Get_group()
    keys = []
    for comm in comms:
        group = comm.Get_group()
        keys.append(tuple(group.Translate_ranks(list(range(comm.Get_size())), world)))
        group.Free()
    world.Free()
    found = all(key in _SHARED for key in keys if len(key) > 1)
    values = np.array([_OWNERS[0] + 1, -int(found)], dtype=np.int64)
    anchor.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
    number, reuse = int(values[0]), int(values[1]) == -1  # every rank found every membership
    _OWNERS[0] = number
    name = label.format(number=number)
    created = {}
    for comm, key in zip(comms, keys):
        if len(key) == 1:  # one rank: nothing to meet
            continue
        if key in created or reuse:
            shared = created.get(key) or _SHARED[key]
        else:
            shared = [comm.Dup(), 0, key, {}]
            shared[0].Set_name(comm.Get_name())
            _SHARED[key] = created[key] = shared
        shared[1] += 1
        shared[3][comm.py2f()] = comm
        _ROUTES[comm.py2f()] = (shared, name, digest(name))
    return number


def unshare_agreements(comms):
    """Stop routing ``comms``' agreements; free a shared communicator no live comm uses. Collective like ``Free``."""
    for comm in comms:
        route = _ROUTES.pop(comm.py2f(), None)
        if route is None:
            continue
        shared = route[0]
        shared[3].pop(comm.py2f(), None)
        shared[1] -= 1
        if shared[1] == 0:
            if _SHARED.get(shared[2]) is shared:
                del _SHARED[shared[2]]
            forget_timeout(shared[0])
            shared[0].Free()


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
    _wait([request], comm, call, None, sleep=True)


SLEEPING_WAIT_BYTES = 1 << 16  # collectives up to this size wait sleeping; larger ones poll


def wait_collective(request, comm, call, nbytes):
    """Complete the non-blocking collective ``request`` on ``comm`` moving ``nbytes`` per rank; bounded.

    A small one (up to :data:`SLEEPING_WAIT_BYTES`) is done in microseconds once every rank has
    arrived, so a waiting rank sleeps between polls once the wait lasts 1 ms, leaving the cores to
    the ranks it waits for (a blocking collective's busy poll holds them where ranks outnumber
    cores). A larger one moves only while the ranks poll (no progress thread), so it polls and
    yields. Either way it raises RuntimeError after :func:`timeout_seconds`.
    """
    _wait([request], comm, call, None, sleep=nbytes <= SLEEPING_WAIT_BYTES)


def allgather_ints(comm, values, call):
    """Return every rank's ``values`` (a tuple of ints, as long on every rank), one row per rank; collective.

    One non-blocking Allgather, completed by :func:`wait_collective` (bounded; a
    blocking collective's busy poll would hold the cores the ranks it waits for need).
    """
    mine = np.asarray(values, dtype=np.int64)
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    wait_collective(comm.Iallgather(mine, everyone), comm, call, everyone.nbytes)
    return [tuple(int(v) for v in row) for row in everyone]


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
    _wait(requests, comm, call, awaiting, sleep=False)


def _wait(requests, comm, call, awaiting, sleep, statuses=None, enough=None):
    """Poll ``requests`` until done (return True) or past the deadline; ``sleep``: also sleep between polls after 1 ms.

    ``statuses``, if given, receive the requests' statuses as they complete. ``enough``, one of
    ``requests``: once it is complete (left for its owner to complete again), stop and return False.
    """
    testall = mpi().Request.Testall
    if testall(requests, statuses):
        return True
    start = time.monotonic()
    pause, limit = 0.0, False  # the setting is read once a wait lasts 1 ms, not on the fast path
    while not testall(requests, statuses):
        if enough is not None and enough.Get_status():
            return False
        waited = time.monotonic() - start
        _yield_core(waited)
        if waited > 0.001:
            if limit is False:
                limit = timeout_seconds()
            if limit is not None and waited > limit:
                raise _timed_out(requests, comm, call, awaiting, waited, limit)
            if sleep:
                pause = min(0.01, pause + 0.0001)
                time.sleep(pause)
    return True


def _timed_out(requests, comm, call, awaiting, waited, limit):
    """The RuntimeError of a wait past its deadline; marks ``comm`` out of step."""
    where = "this rank"
    if comm is not None:
        _TIMED_OUT.add(comm.py2f())
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


def _yield_core(waited):
    """After a short spin, give the core to any other runnable process (a no-op when none is)."""
    if waited > 20e-6:
        os.sched_yield()

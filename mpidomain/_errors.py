"""Errors raised on every rank: a mistake one rank sees never leaves the others waiting.

:func:`raise_on_all_ranks` and :func:`check_same` gather each rank's local
error (or value) and raise the same exception everywhere; :func:`fence` bounds
the wait before a blocking collective; :func:`digest` is what an agreement
compares. Above ``_waits.py`` (each collective step waits with the deadline).
"""

import hashlib

from ._waits import wait_with_deadline

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
    lines = [f"rank{'s' * (len(r) > 1)} {rank_ranges(r)}: {m}" for m, r in by_message.items()]
    raise kind(
        f"{len(failed)} of {len(reports)} ranks rejected the call:\n  " + "\n  ".join(lines)
    )


def rank_ranges(ranks):
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

"""Errors raised alike on every rank, and what an agreement compares.

:func:`error_report` and :func:`raise_reported` turn each rank's gathered
local error into the same exception everywhere (what
:func:`mpidomain._agreement.agree`, the one collective check, raises);
:func:`digest` is what an agreement compares; :func:`rank_ranges` formats
ranks in messages; :func:`raised_alike` marks an exception that every rank
of a group raises (so a command can tell it from one rank's own failure).
Local: no communication.
"""

import hashlib


_KINDS = (ValueError, TypeError, NotImplementedError)  # kept across ranks; any other becomes RuntimeError


def error_report(error):
    """Return what :func:`raise_reported` needs of this rank's ``error`` (None if none), to gather."""
    if error is None:
        return None
    kind = next((k for k in _KINDS if isinstance(error, k)), type(error))
    return kind.__name__, str(error)


def raised_alike(error, comm=None):
    """Mark ``error`` as raised alike on every rank of ``comm`` (None: of the whole job); return it."""
    error.mpidomain_raised_alike = -1 if comm is None else comm.Get_size()
    return error


def raised_alike_on(error):
    """Return how many ranks raised ``error`` (or an exception it was raised from) alike: -1 for every rank of the
    job, 0 if it is not marked (:func:`raised_alike`)."""
    seen = set()
    while error is not None and id(error) not in seen:
        ranks = getattr(error, "mpidomain_raised_alike", 0)
        if ranks:
            return ranks
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return 0


def raise_reported(reports, error=None, comm=None):
    """Raise, alike on every rank, if any rank's gathered :func:`error_report` holds an error.

    ``reports`` is every rank's report, in rank order; ``error`` this rank's own; ``comm`` the ranks that
    gathered them (marked on the error, :func:`raised_alike`).
    """
    failed = [(rank, report) for rank, report in enumerate(reports) if report]
    if not failed:
        return
    kinds = {kind.__name__: kind for kind in _KINDS}
    by_message = {}
    for rank, (_, message) in failed:
        by_message.setdefault(message, []).append(rank)
    if error is not None and len(by_message) == 1 and len(failed) == len(reports):
        raise raised_alike(error, comm)
    kind = kinds.get(failed[0][1][0], RuntimeError)
    lines = [f"rank{'s' * (len(r) > 1)} {rank_ranges(r)}: {m}" for m, r in by_message.items()]
    raise raised_alike(kind(
        f"{len(failed)} of {len(reports)} ranks rejected the call:\n  " + "\n  ".join(lines)
    ), comm)


def describe_error(error, limit=500):
    """``Type: message`` on one line (a message of several lines joined), at most ``limit`` characters of it."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines())
    return f"{type(error).__name__}: {text[:limit]}"


def rank_ranges(ranks):
    """Format sorted ranks compactly: [0, 1, 2, 5] -> '0-2,5'."""
    spans = [[ranks[0], ranks[0]]]
    for rank in ranks[1:]:
        if rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def digest(value):
    """Return a 62-bit digest of ``repr(value)``: what :func:`agree` compares across ranks."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2

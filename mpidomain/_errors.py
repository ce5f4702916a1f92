"""Errors raised alike on every rank, and what an agreement compares.

:func:`error_report` and :func:`raise_reported` turn each rank's gathered
local error into the same exception everywhere (what
:func:`mpidomain._agreement.agree`, the one collective check, raises);
:func:`digest` is what an agreement compares; :func:`rank_ranges` formats
ranks in messages. Local: no communication.
"""

import hashlib


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


def digest(value):
    """Return a 62-bit digest of ``repr(value)``: what :func:`agree` compares across ranks."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2

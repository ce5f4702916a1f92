"""A clean stop on the scheduler's warning signal, decided by every rank at the same step boundary.

Schedulers warn a job before they end it: Slurm with ``--signal=USR1@120``
(``B:`` for the batch shell), PBS with SIGTERM some seconds before SIGKILL.
The signal may reach some ranks only, or each at another moment. A
:class:`StopSignals` records it where it arrives and does nothing else; at
every step boundary :meth:`StopSignals.requested` settles it over the group
(one small agreement step), so every rank stops after the same step, saves
the same checkpoint, and the job exits 0.
"""

import signal

from ._agreement import agree
from ._errors import rank_ranges

__all__ = ["StopSignals", "signal_number"]


def signal_number(name):
    """Return the number of signal ``name`` (``"SIGUSR1"``, ``"USR1"`` or ``"10"``); ValueError if it names none."""
    text = str(name).strip().upper()
    if text.isdigit():
        number = int(text)
        if number in {int(s) for s in signal.Signals}:
            return number
    else:
        found = getattr(signal.Signals, text if text.startswith("SIG") else f"SIG{text}", None)
        if found is not None and found not in (signal.SIGKILL, signal.SIGSTOP):
            return int(found)
    catchable = ", ".join(s for s in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP") if hasattr(signal, s))
    raise ValueError(f"{name!r} is not a signal a process can catch here; use one of {catchable}")


class StopSignals:
    """Record ``signals`` on this rank; :meth:`requested` tells every rank of ``comm`` whether any rank got one.

    A context manager: entering installs handlers that only record the signal (the previous handlers come back
    on exit). Local to install; :meth:`requested` is collective.
    """

    def __init__(self, comm, signals=("SIGTERM", "SIGUSR1")):
        self._comm = comm
        self._numbers = tuple(dict.fromkeys(signal_number(s) for s in signals))
        self._previous = {}
        self._got = 0
        self.received = None

    def __enter__(self):
        for number in self._numbers:
            self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()
        return False

    def _record(self, number, frame):
        if not self._got:
            self._got = number

    @property
    def names(self):
        """The signals this object records, e.g. ``("SIGTERM", "SIGUSR1")``."""
        return tuple(signal.Signals(n).name for n in self._numbers)

    def requested(self):
        """Return True on every rank of the group if any rank has received one of the signals.

        Collective over the group: call on every rank at each step boundary. When True, :attr:`received` says
        which signal reached which ranks, e.g. ``"SIGUSR1 on ranks 0-3"``.
        """
        if not agree(self._comm, "the stop signals (at a step boundary)", None, flag=bool(self._got)):
            return False
        got = self._comm.allgather(self._got)
        by_signal = {}
        for rank, number in enumerate(got):
            if number:
                by_signal.setdefault(signal.Signals(number).name, []).append(rank)
        self.received = ", ".join(f"{name} on rank{'s' * (len(r) > 1)} {rank_ranges(r)}"
                                  for name, r in by_signal.items())
        return True

"""Count the bytes each rank sends, and time its waits for messages: off by default, free when off.

The library's senders (halo plans, ``redistribute``, ``allreduce``, gradient
all-reduces, agreement steps) report here only while a :class:`Recorder` is
open (``recorder`` is not None); with none open each costs one attribute test.
:class:`mpidomain.nn.CommStats` opens one and names the layer each message
belongs to. :class:`WaitTimer` adds up the seconds spent completing MPI
requests and in blocking collectives (``timer`` is not None while one is open).

Lowest layer: imports nothing of the package, so every sender may import it.
"""

import time

__all__ = ["OPS", "Recorder", "WaitTimer", "recorder", "timer", "sent", "waited"]

#: What a sender reports: ``halo`` (a halo exchange's messages, forward or adjoint), ``alltoall``
#: (rows re-distributed), ``allreduce`` (the reduced buffer), ``control`` (agreement steps, extents).
OPS = ("halo", "alltoall", "allreduce", "control")

recorder = None  # the open Recorder, or None (the switch every sender tests)
timer = None  # the open WaitTimer, or None


def sent(op, nbytes, layer=None):
    """Report ``nbytes`` sent by this rank as ``op`` (one of :data:`OPS`) to the open recorder, if any.

    ``layer``: the kind of layer, when the sender knows it (gradients); else the recorder asks its
    ``classify``. Local. Senders call it only after testing ``comm_stats.recorder is not None``.
    """
    open_recorder = recorder
    if open_recorder is not None:
        open_recorder.add(op, nbytes, layer)


def waited(seconds):
    """Add ``seconds`` spent waiting for messages to the open :class:`WaitTimer`, if any. Local."""
    open_timer = timer
    if open_timer is not None:
        open_timer.seconds += seconds
        open_timer.waits += 1


class Recorder:
    """Bytes sent per (op, layer kind) while open; ``classify(op)`` names the layer kind (default ``"other"``).

    Use as a context manager; one recorder may be open at a time (per process). Local.
    """

    def __init__(self, classify=None):
        self.classify = classify
        self.bytes = {}  # (op, kind) -> bytes
        self.messages = {}  # (op, kind) -> calls
        self._previous = None

    def add(self, op, nbytes, layer=None):
        """Count ``nbytes`` of ``op``, under ``layer`` or what ``classify`` says. Local."""
        if layer is None:
            layer = self.classify(op) if self.classify is not None else "other"
        key = (op, layer)
        self.bytes[key] = self.bytes.get(key, 0) + int(nbytes)
        self.messages[key] = self.messages.get(key, 0) + 1

    def __enter__(self):
        global recorder
        if recorder is not None:
            raise RuntimeError("a CommStats (comm_stats.Recorder) is already open in this process; close it first "
                               "(one at a time: nested ones would count each message twice)")
        self._previous, recorder = recorder, self
        return self

    def __exit__(self, *exc):
        global recorder
        recorder = self._previous
        return False


class WaitTimer:
    """Seconds this rank spent completing MPI requests and in blocking collectives while open.

    ``seconds`` and ``waits`` (the number of waits) add up; reset them to reuse the timer. Timers nest:
    an inner one takes the waits while it is open. Local.
    """

    def __init__(self):
        self.seconds = 0.0
        self.waits = 0
        self._previous = None

    def __enter__(self):
        global timer
        self._previous, timer = timer, self
        return self

    def __exit__(self, *exc):
        global timer
        timer = self._previous
        return False


def clock():
    """The clock the waits are timed by (``time.perf_counter``)."""
    return time.perf_counter()

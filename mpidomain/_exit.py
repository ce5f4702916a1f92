"""Interpreter exit: the library's finalizers stand down before Python tears its modules down.

At exit Python runs the ``atexit`` callbacks, then sets module globals to
None (which a ``__del__`` run later still needs), and mpi4py finalises MPI
last (``Py_AtExit``). A class whose ``__del__`` frees MPI handles or warns is
decorated with :func:`stands_down_at_exit`: from the ``atexit`` callback on,
its ``_exiting`` is True and its ``__del__`` returns at once, reading no
global; MPI_Finalize reclaims what is left. Local: no communication (at exit
the other ranks may be gone, so nothing collective can run).
"""

import atexit

__all__ = ["stands_down_at_exit"]

_CLASSES = []


def stands_down_at_exit(cls):
    """Register ``cls`` (a class decorator): ``cls._exiting`` is False until the interpreter exits."""
    cls._exiting = False
    _CLASSES.append(cls)
    return cls


@atexit.register
def _stand_down():
    for cls in _CLASSES:
        cls._exiting = True

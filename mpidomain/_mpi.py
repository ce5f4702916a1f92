"""Lazy access to mpi4py: ``mpi()`` and ``is_active()``; the bottom of the package's imports.

Importing this module does not start MPI: ``mpi()`` imports ``mpi4py.MPI``
(which initialises the library) at the first call that needs it. The
collective helpers built on it live above it: ``_waits.py`` (waits with a
deadline), ``_errors.py`` (errors raised on every rank), ``_routing.py``
(agreements of several managers meeting on shared communicators) and
``_agreement.py`` (the agreement step every entry point starts with).
"""

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

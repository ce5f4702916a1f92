"""The current manager: the slot ``initialize_domain_parallel`` fills, and the one resolver every entry point uses.

Local: no communication. Below the manager in the import order (it holds a
manager without importing its module), so any module may ask for it.
"""

from ._mpi import mpi

_MANAGER = None


def current_manager():
    """Return the manager ``initialize_domain_parallel`` made current, or None."""
    return _MANAGER


def make_current(manager):
    """Make ``manager`` the current one; return the previous one (or None)."""
    global _MANAGER
    previous, _MANAGER = _MANAGER, manager
    return previous


def forget(manager):
    """Clear the slot if it holds ``manager`` (it is closing)."""
    global _MANAGER
    if _MANAGER is manager:
        _MANAGER = None


def closed_error(manager):
    """Return the RuntimeError for using ``manager`` after its close()."""
    return RuntimeError(f"{manager!r} is closed; pass an open manager or call initialize_domain_parallel again")


def require_manager(manager, what, alone_ok=False,
                    fix="call mpidomain.initialize_domain_parallel(world_size, domain_parallel_size) first, "
                        "or pass manager="):
    """Return ``manager``, else the current one; raise RuntimeError if none or closed.

    With ``alone_ok``, a job of one process with no manager gets None (the
    caller then works locally, as on a group of one rank); with several
    processes, a missing manager is always an error: silently working alone
    would give each rank a different answer. ``fix`` ends the message.
    """
    if manager is None:
        manager = _MANAGER
    if manager is None:
        processes = mpi().COMM_WORLD.Get_size()
        if alone_ok and processes == 1:
            return None
        raise RuntimeError(f"{what} needs a domain-parallel manager, but none is initialised in this "
                           f"{processes}-process job; {fix}")
    if manager.closed:
        raise closed_error(manager)
    return manager

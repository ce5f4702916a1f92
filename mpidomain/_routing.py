"""Routing between managers: agreements of library communicators with the same members meet on one communicator.

Each manager's private communicators get an owner (a number the ranks agree
on, and a name); an agreement on any of them travels through the one
communicator shared by every live owner's communicators of that membership,
with the owner in its digest. Ranks of one group using different managers in
the same call thus meet there and raise, naming the managers, instead of
waiting on two communicators until the timeout. Above ``_errors.py``.
"""

import numpy as np

from ._errors import digest
from ._mpi import mpi
from ._waits import forget_timeout, group_name

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


def route(comm):
    """Return ``(agreement communicator, owner's name, digest of the name)`` of ``comm``: where its agreements travel.

    ``(comm, None, 0)`` for a communicator no :func:`share_agreements` routed. Local.
    """
    entry = _ROUTES.get(comm.py2f())
    if entry is None:
        return comm, None, 0
    shared, owner, mark = entry
    return shared[0], owner, mark


def routed_comm(shared, name):
    """The communicator named ``name`` whose agreements route through ``shared`` (this rank's handle of it)."""
    for handle, (entry, owner, _) in _ROUTES.items():
        if entry[0] is shared and owner == name:
            return entry[3][handle]
    raise RuntimeError(f"no communicator of {name} routes its agreements through {group_name(shared)}")

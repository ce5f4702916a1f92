"""What a layer decides from the other ranks' extents (its windows, a move): constants of a compiled graph.

A converted layer learns the other ranks' extents in a collective (an agreement step, then an allgather of
a few integers) before its halo exchange or all-to-all. In eager code that runs every call. In a compiled
graph the answer must be a constant, known when Dynamo traces, while the fake implementations of the
operators (:mod:`mpidomain.nn.ops`) communicate nothing. :func:`planned` gives it: while Dynamo traces, the
collective runs at trace time, with its agreement step, and its answer is baked into the graph
(``torch.compiler.assume_constant_result``).

Every rank traces the same calls together, as on a first compilation, so every rank runs the same
collectives. A rank that recompiles alone (a guard failed on it only: another shard extent) runs the
collective while the others run their compiled graphs: it meets their run-time operators' agreement step, and
every rank of the group raises ("different mpidomain calls") instead of waiting. Nothing is remembered from one
trace to the next: an answer kept by one rank, keyed on what that rank alone sees (its own extents), could be
another global layout's (an earlier call on another field size) and baked in silently.
"""

import torch

from ._compile_marks import constant_result
from .ops import compiling

__all__ = ["planned", "register_gather"]

_GATHERS = {}  # call -> gather(manager, key): the collective that answers it


def register_gather(call, gather):
    """Make ``gather(manager, key)`` the collective that answers :func:`planned` ``call``. Local (at import)."""
    _GATHERS[call] = gather


def planned(manager, call, key):
    """Return what collective ``call`` (:func:`register_gather`) returns for ``key`` on ``manager``.

    Collective over the call's group, in eager code and while Dynamo traces alike (every rank of the group
    traces it together); in a compiled graph, the traced answer is a constant.
    """
    if not compiling():
        return _GATHERS[call](manager, key)
    return _planned(manager, call, key)


@constant_result
def _planned(manager, call, key):
    return _GATHERS[call](manager, key)

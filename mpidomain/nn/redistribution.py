"""``Redistribute``: :func:`mpidomain.redistribution.redistribute` in autograd.

Forward deals the rows of a sharded dim out anew (one all-to-all); backward
is the exact adjoint of that permutation of rows: the gradient's rows travel
back along the inverse move to the ranks they came from.
"""

import torch

from .._current import require_manager
from ..redistribution import redistribute
from . import ops

__all__ = ["Redistribute", "inverse_move", "redistribute_rows"]


class _RedistributeFunction(torch.autograd.Function):
    """Move rows along a move; backward moves the gradient's rows along its inverse."""

    @staticmethod
    def forward(ctx, x, move, dim, manager):
        ctx.arguments = (move, dim, manager)
        return redistribute(x.detach(), move, dim, manager=manager)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        move, dim, manager = ctx.arguments
        return redistribute(grad.contiguous(), inverse_move(move), dim, manager=manager), None, None, None


def redistribute_rows(x, move, dim, manager=None):
    """Return this rank's rows of ``x`` in ``move``'s target layout along ``dim``; differentiable.

    ``move``: a RowMove, a pair of them (tiles, both dims), or its :func:`mpidomain.nn.ops.move_handle`.

    Collective over the domain group, forward and backward (:func:`mpidomain.redistribution.redistribute`;
    backward the inverse move). While Dynamo traces, the ``mpidomain::redistribute`` operator
    (:mod:`mpidomain.nn.ops`).
    """
    if ops.compiling():
        return ops.redistribute(x, move, dim, require_manager(manager, "redistribute"))
    if isinstance(move, int):  # a handle (mpidomain.nn.ops.move_handle)
        move = ops.moves_of(move)
    return _RedistributeFunction.apply(x, move, dim, manager)


def inverse_move(move):
    """The move back: ``move.inverse``, or the pair of inverses of a pair of moves (tiles, both dims at once)."""
    return tuple(m.inverse for m in move) if isinstance(move, tuple) else move.inverse


class Redistribute(torch.nn.Module):
    """Deal the rows of ``dim`` out as ``move`` says; differentiable (backward: the inverse move).

    Collective over the domain group, forward and backward: every rank calls it
    with its rows in ``move.source``'s layout and gets its rows of
    ``move.target`` (see :func:`mpidomain.redistribution.redistribute`).

    :param move: A :class:`~mpidomain.layout.moves.RowMove` over the ranks that share ``dim``; with
        tiles, a pair of them (latitude's, longitude's) to re-deal both dims in one all-to-all.
    :param dim: A dim the manager shards (with tiles, -2 or -1, or both: ``(-2, -1)`` with a pair of moves).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, move, dim, manager=None):
        super().__init__()
        self.move = tuple(move) if isinstance(move, (tuple, list)) else move
        self.dim = tuple(dim) if isinstance(dim, (tuple, list)) else dim
        self.manager = manager

    def forward(self, x):
        """Return this rank's rows of ``x`` in the target layout (see the class docstring)."""
        return redistribute_rows(x, self.move, self.dim, self.manager)

    def extra_repr(self):
        moves = self.move if isinstance(self.move, tuple) else (self.move,)
        return (f"dim={self.dim}, ranks={'x'.join(str(m.size) for m in moves)}, "
                f"rows={'x'.join(str(len(m.source.order)) for m in moves)}")

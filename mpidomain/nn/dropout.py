"""Random elementwise layers on a shard, drawing as :mod:`mpidomain.nn.rng` says: :class:`DomainParallelDropout`,
:class:`DomainParallelRReLU`."""

import torch

from ._compile_marks import compile_disabled
from ._shard import Wrapper
from .rng import check_rng, dropout_draw, field_slices, tile_dropout, tile_generator

__all__ = ["DomainParallelDropout", "DomainParallelRReLU"]

_NAME = "DomainParallelDropout"


class DomainParallelDropout(Wrapper):
    """An ``nn.Dropout`` or ``nn.AlphaDropout`` on a sharded field, drawing its mask as ``rng`` says.

    ``rng="tile"``: local; each rank draws its shard's mask from its own stream
    (:func:`~mpidomain.nn.rng.tile_generator`). ``rng="one-process"``: collective over the domain group
    (an agreement step and small allgathers: the ranks' extents and one process's memory order): every
    rank draws the whole field's mask as one process draws it and keeps its part, so output and gradients
    equal one process's bitwise and torch's default generator ends where one process's does. Eval mode, or
    ``p = 0``: the identity.

    The input is a field sharded as the manager shards it, as every converted layer takes it. An input of
    fewer than 3 dims (a feature vector after a global pool) is taken to be the same on every rank: it is
    dropped as one process drops it, with the same mask on every rank, in both modes. A 4-D tensor the same on
    every rank (``(B, C, 1, 1)`` after a global pool) is not told apart from a field: leave that dropout
    local (``allow_local``).

    :param module: The ``nn.Dropout`` or ``nn.AlphaDropout`` (kept as ``.module``; its ``p`` and ``inplace``).
    :param rng: ``"tile"`` or ``"one-process"`` (:data:`~mpidomain.nn.rng.RNG_MODES`).
    :param shard_dim: The sharded dims; default (None) the manager's.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, module, rng="tile", shard_dim=None, manager=None):
        if type(module) not in (torch.nn.Dropout, torch.nn.AlphaDropout):
            raise TypeError(f"{_NAME} wraps an nn.Dropout or nn.AlphaDropout, got {type(module).__name__}; convert "
                            "other random layers with a rule of your own (rules=[Rule(...)])")
        super().__init__(module, shard_dim, manager)
        self.rng = check_rng(rng)

    def forward(self, x):
        """Return ``x`` dropped out; collective over the domain group with ``rng="one-process"`` in training."""
        module = self.module
        if not self.training or module.p == 0:
            return x
        alpha = type(module) is torch.nn.AlphaDropout
        if x.ndim < 3:  # the same on every rank: one process's draw, alike everywhere
            return module(x)
        if self.rng == "tile":
            return tile_dropout(x, module.p, alpha, module.inplace, self._manager())
        settings = (type(module).__name__, float(module.p))
        shape, index, order = field_slices(self._manager(), _NAME, x, settings)
        return dropout_draw(x, module.p, alpha, module.inplace, shape, lambda noise: noise[index], order)

    def extra_repr(self):
        return f"rng={self.rng!r}"


class DomainParallelRReLU(Wrapper):
    """An ``nn.RReLU`` on a sharded field, its training slopes drawn from this rank's own stream (``rng="tile"``).

    Local. One process draws a slope for each negative input of the whole field, in order, which depends on
    the other ranks' values, so ``rng="one-process"`` refuses it; here each rank draws its shard's slopes from
    :func:`~mpidomain.nn.rng.tile_generator`, and torch's default generator stays alike on every rank. Eval
    mode: the fixed slope ``(lower + upper) / 2``, as torch's.

    :param module: The ``nn.RReLU`` (kept as ``.module``; its ``lower`` and ``upper``).
    :param shard_dim: The sharded dims; default (None) the manager's.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, module, shard_dim=None, manager=None):
        if type(module) is not torch.nn.RReLU:
            raise TypeError(f"DomainParallelRReLU wraps an nn.RReLU, got {type(module).__name__}")
        super().__init__(module, shard_dim, manager)

    def forward(self, x):
        """Return the RReLU of ``x`` (training: slopes from this rank's stream)."""
        if not self.training:
            return self.module(x)
        return _tile_rrelu(x, self.module.lower, self.module.upper, self._manager())


@compile_disabled
def _tile_rrelu(x, lower, upper, manager):
    return torch.ops.aten.rrelu_with_noise(x, torch.empty_like(x), lower, upper, True,
                                           tile_generator(manager, x.device))

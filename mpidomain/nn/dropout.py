"""Elementwise dropout on a shard: :class:`DomainParallelDropout`, drawing as :mod:`mpidomain.nn.rng` says."""

import torch

from ._shard import Wrapper
from .rng import check_rng, dropout_draw, field_slices, tile_generator

__all__ = ["DomainParallelDropout"]

_NAME = "DomainParallelDropout"


class DomainParallelDropout(Wrapper):
    """An ``nn.Dropout`` or ``nn.AlphaDropout`` on a sharded field, drawing its mask as ``rng`` says.

    ``rng="tile"``: local; each rank draws its shard's mask from its own stream
    (:func:`~mpidomain.nn.rng.tile_generator`). ``rng="one-process"``: collective over the domain group
    (one agreement step and a small allgather per sharded dim): every rank draws the whole field's mask
    as one process draws it and keeps its part, so output and gradients equal one process's bitwise and
    torch's default generator ends where one process's does. Eval mode, or ``p = 0``: the identity.

    :param module: The ``nn.Dropout`` or ``nn.AlphaDropout`` (kept as ``.module``; its ``p`` and ``inplace``).
    :param rng: ``"tile"`` or ``"one-process"`` (:data:`~mpidomain.nn.rng.RNG_MODES`).
    :param shard_dim: The sharded dims; default (None) the manager's.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, module, rng="tile", shard_dim=None, manager=None):
        if type(module) not in (torch.nn.Dropout, torch.nn.AlphaDropout):
            raise TypeError(f"{_NAME} wraps an nn.Dropout or nn.AlphaDropout, got {type(module).__name__}")
        super().__init__(module, shard_dim, manager)
        self.rng = check_rng(rng)

    def forward(self, x):
        """Return ``x`` dropped out; collective over the domain group with ``rng="one-process"`` in training."""
        module = self.module
        if not self.training or module.p == 0:
            return x
        alpha = type(module) is torch.nn.AlphaDropout
        if self.rng == "tile":
            return dropout_draw(x, module.p, alpha, module.inplace, generator=tile_generator(self._manager(),
                                                                                             x.device))
        settings = (type(module).__name__, float(module.p))
        shape, index = field_slices(self._manager(), _NAME, x, settings)
        return dropout_draw(x, module.p, alpha, module.inplace, part=(shape, lambda noise: noise[index]))

    def extra_repr(self):
        return f"rng={self.rng!r}"

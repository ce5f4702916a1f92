"""``PixelUnshuffle`` on a sharded field: local, once every rank's rows come in whole blocks of the factor.

``PixelShuffle`` needs nothing: each input row makes ``r`` output rows, so a
shard's rows ``[a, b)`` become ``[r*a, r*b)``, the rows a transposed
convolution with kernel = stride = ``r`` gives. ``PixelUnshuffle`` folds ``r``
rows into one, which stays on one rank only when every shard's extent is a
multiple of ``r`` (then its rows ``[a, b)`` become ``[a/r, b/r)``, the rows a
stride-``r`` convolution gives); otherwise it raises on every rank.
"""

import torch
import torch.nn.functional as F

from ._shard import Wrapper, layer_agree, shard_dims, spatial_axis

__all__ = ["DomainParallelPixelUnshuffle"]


class DomainParallelPixelUnshuffle(Wrapper):
    """A ``torch.nn.PixelUnshuffle`` on a field sharded along ``shard_dim``; one agreement step, then local.

    Every rank's extent along each sharded dim must be a multiple of the
    factor, or every rank raises ValueError (one agreement step).

    :param shuffle: The ``torch.nn.PixelUnshuffle``, kept as ``.shuffle``.
    :param shard_dim: The sharded dim (the manager's), or ``(-2, -1)`` for tiles.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    _child = "shuffle"

    def __init__(self, shuffle, shard_dim=-2, manager=None):
        if not isinstance(shuffle, torch.nn.PixelUnshuffle):
            raise TypeError(f"DomainParallelPixelUnshuffle wraps a torch.nn.PixelUnshuffle, got "
                            f"{type(shuffle).__name__}")
        super().__init__(shuffle, shard_dim, manager)

    def forward(self, x):
        """Return this rank's rows of the unshuffled whole field; collective (one agreement step)."""
        name, manager, r = type(self).__name__, self._manager(), self.shuffle.downscale_factor
        for sd in shard_dims(self.shard_dim):
            dim, _ = spatial_axis(x, sd, 2, name)
            error = None
            if x.shape[dim] % r:
                error = ValueError(f"{name}(downscale_factor={r}): a shard holds {x.shape[dim]} rows along dim {dim}, "
                                   f"not a multiple of {r}, so its blocks of {r} rows would straddle ranks; shard the "
                                   f"field in multiples of {r} rows (shard_tensor with a length divisible by "
                                   f"{r} x the domain size)")
            layer_agree(manager, name, x, dim, (r,), error)
        return F.pixel_unshuffle(x, r)

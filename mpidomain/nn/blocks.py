"""Blocks whose exactness needs more than converting their children, matched by what they hold.

The converter cannot see a forward, so these are recognised by their children's
names and types (no import of the projects that define them):

- an ECA block (``avg_pool``: ``AdaptiveAvgPool2d(1)``, ``conv``: ``Conv1d``,
  ``sigmoid``): the global mean is converted (replicated on every rank) and
  its ``Conv1d`` runs over that mean's channels, so it stays local;
- a coordinate-attention block (``pool_h``: ``AdaptiveAvgPool2d((None, 1))``,
  ``pool_w``: ``AdaptiveAvgPool2d((1, None))``, ``conv1``, ``bn1``: ``BatchNorm2d``,
  ``act``, ``conv_h``, ``conv_w``, ``sigmoid``): its BatchNorm normalises the
  concatenation of the per-row means (sharded with the rows) and the
  per-column means (replicated over the ranks of a tile column), so it
  becomes :class:`DomainParallelCoordinateAttention`.
"""

import torch
from torch.nn.modules.utils import _pair

from ._shard import Wrapper, place, shard_dims, spatial_axis
from .norm import batch_norm
from .pool import adaptive_pool

__all__ = ["BLOCK_CONVERTERS", "CHILD_RULES", "DomainParallelCoordinateAttention", "coordinate_attention_like",
           "eca_like"]

nn = torch.nn


def _children(module):
    return {name: child for name, child in module._modules.items() if child is not None}


def _pointwise_conv(conv):
    return (isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1)
            and conv.padding in ((0, 0), "valid"))


def eca_like(module):
    """Return ``{child: why it stays local}`` if ``module`` holds an ECA block's children, else None."""
    children = _children(module)
    if set(children) != {"avg_pool", "conv", "sigmoid"}:
        return None
    pool, conv, sigmoid = children["avg_pool"], children["conv"], children["sigmoid"]
    if (type(pool) is nn.AdaptiveAvgPool2d and _pair(pool.output_size) == (1, 1) and type(conv) is nn.Conv1d
            and isinstance(sigmoid, nn.Sigmoid)):
        return {"conv": "an ECA block's Conv1d: it convolves the channels of the global mean, the same on every rank"}
    return None


def coordinate_attention_like(module):
    """Return True if ``module`` holds a coordinate-attention block's children (see the module docstring)."""
    children = _children(module)
    names = {"pool_h", "pool_w", "conv1", "bn1", "act", "conv_h", "conv_w", "sigmoid"}
    if set(children) != names:
        return False
    pool_h, pool_w = children["pool_h"], children["pool_w"]
    return (type(pool_h) is nn.AdaptiveAvgPool2d and _pair(pool_h.output_size) == (None, 1)
            and type(pool_w) is nn.AdaptiveAvgPool2d and _pair(pool_w.output_size) == (1, None)
            and type(children["bn1"]) is nn.BatchNorm2d
            and all(_pointwise_conv(children[c]) for c in ("conv1", "conv_h", "conv_w")))


class DomainParallelCoordinateAttention(Wrapper):
    """Coordinate attention on a sharded field (B, C, H, W); collective, forward and backward.

    ``x * a_h * a_w`` with ``a_h`` from the means over W of each row and
    ``a_w`` from the means over H of each column: both pass together through
    ``conv1``, ``bn1`` and ``act`` (concatenated along dim 2), then ``conv_h``
    / ``conv_w`` and ``sigmoid``. The means along a sharded dim are domain
    all-reduces; the BatchNorm's statistics count each row mean once and each
    column mean once, wherever the ranks hold copies. Each rank gets its own
    rows of the single-process output; the parameters stay the block's (same
    state_dict keys).

    :param block: The block, with children ``pool_h``, ``pool_w``, ``conv1``, ``bn1``, ``act``, ``conv_h``,
        ``conv_w``, ``sigmoid`` (kept as ``.block``).
    :param shard_dim: The sharded dim (the manager's), or ``(-2, -1)`` for tiles.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    _child = "block"

    def __init__(self, block, shard_dim=-2, manager=None):
        if not coordinate_attention_like(block):
            raise TypeError(f"DomainParallelCoordinateAttention wraps a coordinate-attention block, got "
                            f"{type(block).__name__} with children {sorted(_children(block))}")
        super().__init__(block, shard_dim, manager)

    def forward(self, x):
        """Return this rank's rows of the block's output on the whole field; collective over the domain group."""
        x = self._pre_hooks(x)
        block, manager, name = self.block, self._manager(), type(self).__name__
        if x.ndim != 4:
            raise ValueError(f"{name} expects (B, C, H, W) inputs, got shape {tuple(x.shape)}")
        for sd in shard_dims(self.shard_dim):
            spatial_axis(x, sd, 2, name)
        h, w = x.shape[2], x.shape[3]
        rows_mean = adaptive_pool(x, (None, 1), "avg", self.shard_dim, manager, name)  # (B, C, h, 1)
        cols_mean = adaptive_pool(x, (1, None), "avg", self.shard_dim, manager, name)  # (B, C, 1, w)
        y = block.act(self._norm(block.conv1(torch.cat([rows_mean, cols_mean.permute(0, 1, 3, 2)], 2)), x, h, w))
        y_h, y_w = torch.split(y, [h, w], 2)
        a_h = block.sigmoid(block.conv_h(y_h))
        a_w = block.sigmoid(block.conv_w(y_w.permute(0, 1, 3, 2)))
        return x * a_h * a_w

    def _norm(self, y, x, h, w):
        """``bn1`` over the concatenated means, each counted once over the domain group."""
        manager = self._manager()
        lat, _ = place(manager, x, 2)
        lon, _ = place(manager, x, 3)
        counted = torch.cat([torch.full((h,), float(lon == 0)), torch.full((w,), float(lat == 0))])
        return batch_norm(y, self.block.bn1, manager, counted.to(y.device).view(1, 1, -1, 1))


#: ``(matches(module) -> bool, factory(module, shard_dim, manager) -> replacement)``: blocks the converter
#: replaces whole, tried in order after ``custom_converters`` (the replacement's children are its own).
BLOCK_CONVERTERS = (
    (coordinate_attention_like, DomainParallelCoordinateAttention),
)

#: ``rule(parent) -> {child name: why it stays local} or None``: children a block's structure makes local.
CHILD_RULES = (eca_like,)

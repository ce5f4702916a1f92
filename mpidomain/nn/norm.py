"""GroupNorm over a sharded field, with statistics of the whole field that autograd sees.

CREDIT's domain-parallel GroupNorm all-reduces its statistics outside
autograd, so its input gradients are wrong whenever a GroupNorm is sharded.
Here the sums go through :func:`mpidomain.allreduce`, which is differentiable:
forward and backward equal the single-process ``torch.nn.GroupNorm`` to round-off.
"""

import torch

from ..reduce import allreduce
from ._shard import Wrapper

__all__ = ["DomainParallelGroupNorm"]


class DomainParallelGroupNorm(Wrapper):
    """A ``torch.nn.GroupNorm`` whose mean and variance are those of the whole (sharded) field.

    Collective over the domain group, forward and backward: each rank passes
    its shard (any extents along the sharded dim) and gets its rows of the
    single-process output. Two differentiable all-reduces (two-pass, in float64:
    the (B, G) sums with the element count, then the squared deviations).

    :param norm: The GroupNorm; it keeps the parameters (``.norm``, same state_dict keys).
    :param shard_dim: The sharded dim (only recorded: the statistics span every dim but B and C).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    _child = "norm"

    def __init__(self, norm, shard_dim=-2, manager=None):
        if not isinstance(norm, torch.nn.GroupNorm):
            raise TypeError(f"DomainParallelGroupNorm wraps a torch.nn.GroupNorm, got {type(norm).__name__}")
        super().__init__(norm, shard_dim, manager)

    def forward(self, x):
        """Return this rank's rows of the group-normalised whole field; collective over the domain group."""
        x = self._pre_hooks(x)
        norm, manager = self.norm, self._manager()
        if x.ndim < 2 or x.shape[1] != norm.num_channels:
            raise ValueError(f"DomainParallelGroupNorm expects (B, {norm.num_channels}, ...) inputs, got shape "
                             f"{tuple(x.shape)}")
        batch, groups = x.shape[0], norm.num_groups
        grouped = x.reshape(batch, groups, -1)
        # One all-reduce of the sums with the element count in float64 (exact to 2**53), one of the squares.
        count = torch.full((batch, 1), float(grouped.shape[-1]), dtype=torch.float64, device=x.device)
        sums = allreduce(torch.cat([grouped.sum(-1).double(), count], dim=1), "sum", "domain", manager)
        total = sums[:, -1:]
        mean = (sums[:, :-1] / total).to(x.dtype)
        centred = grouped - mean.unsqueeze(-1)
        var = (allreduce((centred * centred).sum(-1).double(), "sum", "domain", manager) / total).to(x.dtype)
        out = (centred / torch.sqrt(var + norm.eps).unsqueeze(-1)).reshape(x.shape)
        if norm.affine:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            out = out * norm.weight.view(shape) + norm.bias.view(shape)
        return out

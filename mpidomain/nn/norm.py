"""GroupNorm over a sharded field, with statistics of the whole field that autograd sees.

CREDIT's domain-parallel GroupNorm all-reduces its statistics outside
autograd, so its input gradients are wrong whenever a GroupNorm is sharded.
Here the backward all-reduces the two sums its input gradient needs: forward and
backward equal the single-process ``torch.nn.GroupNorm`` to round-off, and like it
the layer keeps only its input and the (B, G) mean and 1/std for backward.
"""

import torch

from ..reduce import allreduce
from ._shard import Wrapper

__all__ = ["DomainParallelGroupNorm"]


class DomainParallelGroupNorm(Wrapper):
    """A ``torch.nn.GroupNorm`` whose mean and variance are those of the whole (sharded) field.

    Collective over the domain group, forward and backward: each rank passes
    its shard (any extents along the sharded dim) and gets its rows of the
    single-process output. Two all-reduces forward (two-pass, in float64: the
    (B, G) sums with the element count, then the squared deviations), one backward.

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
        return _GroupNormFunction.apply(x, norm.weight if norm.affine else None, norm.bias if norm.affine else None,
                                        norm.num_groups, norm.eps, manager)


def _sum_over_domain(partial, manager):
    """The (B, K) float64 sums ``partial`` over the domain group (not tracked by autograd)."""
    return allreduce(partial.double(), "sum", "domain", manager)


class _GroupNormFunction(torch.autograd.Function):
    """GroupNorm with whole-field statistics; saves only the input and the (B, G) mean and 1/std.

    Backward all-reduces two (B, G) sums (of the gradient and of the gradient times the
    normalised input), so the input gradient is the whole field's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, manager):
        batch = x.shape[0]
        grouped = x.reshape(batch, groups, -1)
        # One all-reduce of the sums with the element count in float64 (exact to 2**53), one of the squares.
        count = torch.full((batch, 1), float(grouped.shape[-1]), dtype=torch.float64, device=x.device)
        sums = _sum_over_domain(torch.cat([grouped.sum(-1).double(), count], dim=1), manager)
        total = sums[:, -1:]
        mean = (sums[:, :-1] / total).to(x.dtype)
        centred = grouped - mean.unsqueeze(-1)
        var = (_sum_over_domain((centred * centred).sum(-1), manager) / total).to(x.dtype)
        rstd = 1 / torch.sqrt(var + eps)
        out = (centred * rstd.unsqueeze(-1)).reshape(x.shape)
        if weight is not None:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            out = out * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.groups, ctx.manager, ctx.total = groups, manager, total
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        batch, groups = x.shape[0], ctx.groups
        normalised = (x.reshape(batch, groups, -1) - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        grad_weight = grad_bias = None
        if weight is not None:
            shape = (1, -1) + (1,) * (x.ndim - 2)
            dims = [0] + list(range(2, x.ndim))
            if ctx.needs_input_grad[1]:
                grad_weight = (grad * normalised.reshape(x.shape)).sum(dims)
            if ctx.needs_input_grad[2]:
                grad_bias = grad.sum(dims)
            grad = grad * weight.view(shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grouped = grad.reshape(batch, groups, -1)
            sums = _sum_over_domain(torch.cat([grouped.sum(-1), (grouped * normalised).sum(-1)], dim=1),
                                    ctx.manager) / ctx.total
            mean_grad, mean_projection = sums[:, :groups].to(x.dtype), sums[:, groups:].to(x.dtype)
            grad_x = (rstd.unsqueeze(-1) * (grouped - mean_grad.unsqueeze(-1)
                                            - normalised * mean_projection.unsqueeze(-1))).reshape(x.shape)
        return grad_x, grad_weight, grad_bias, None, None, None

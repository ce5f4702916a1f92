"""GroupNorm and BatchNorm over a sharded field, with statistics of the whole field that autograd sees.

CREDIT's domain-parallel GroupNorm all-reduces its statistics outside
autograd, so its input gradients are wrong whenever a GroupNorm is sharded.
Here the backward all-reduces the two sums its input gradient needs: forward and
backward equal the single-process ``torch.nn.GroupNorm`` to round-off, and like it
the layer keeps only its input and the (B, G) mean and 1/std for backward.
"""

import torch
import torch.nn.functional as F

from ..reduce import allreduce
from ._shard import Wrapper
from .precision import float32_work, output_dtype

__all__ = ["DomainParallelBatchNorm", "DomainParallelGroupNorm", "batch_norm"]


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
        dtype = output_dtype(x, "group_norm")
        with torch.autocast(x.device.type, enabled=False):  # float32 work for half precision, as torch's kernels
            out = _GroupNormFunction.apply(float32_work(x), norm.weight if norm.affine else None,
                                           norm.bias if norm.affine else None, norm.num_groups, norm.eps, manager)
        return out.to(dtype)


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

def batch_norm(x, norm, manager, counted=None):
    """Return ``norm`` (a BatchNorm) applied to ``x`` with the statistics of the whole field; differentiable.

    Collective over the domain group when the batch statistics are used (training, or no running
    statistics): per channel, one differentiable all-reduce of the sums with the element count
    (float64), one of the squared deviations. ``counted`` (broadcastable to ``x``, 0 or 1) marks the
    elements this rank contributes; other ranks hold the rest (default: every element is this
    rank's own). With running statistics in eval mode it is local. In training the running
    statistics move as ``torch.nn.BatchNorm`` moves them, by the whole field's mean and unbiased
    variance, alike on every rank.
    """
    if not norm.training and norm.running_mean is not None:
        return F.batch_norm(x, norm.running_mean, norm.running_var, norm.weight, norm.bias, False, 0.0, norm.eps)
    dtype = output_dtype(x, "batch_norm")
    with torch.autocast(x.device.type, enabled=False):  # float32 work for half precision, as torch's kernels
        return _batch_norm(float32_work(x), norm, manager, counted).to(dtype)


def _batch_norm(x, norm, manager, counted):
    """:func:`batch_norm` with the batch statistics, in ``x``'s dtype."""
    channels = x.shape[1]
    flat = x.transpose(0, 1).reshape(channels, -1)
    if counted is None:
        weights = None
        count = torch.full((1,), float(flat.shape[1]), dtype=torch.float64, device=x.device)
    else:
        weights = torch.broadcast_to(counted.to(x.dtype), x.shape).transpose(0, 1).reshape(channels, -1)[0]
        count = weights.double().sum().reshape(1)
    own = flat if weights is None else flat * weights
    sums = allreduce(torch.cat([own.sum(1).double(), count]), "sum", "domain", manager)
    total = sums[-1]
    mean = (sums[:-1] / total).to(x.dtype)
    centred = flat - mean.unsqueeze(1)
    squares = centred * centred if weights is None else centred * centred * weights
    var = (allreduce(squares.sum(1).double(), "sum", "domain", manager) / total).to(x.dtype)
    out = centred / torch.sqrt(var + norm.eps).unsqueeze(1)
    if norm.affine:
        out = out * norm.weight.unsqueeze(1) + norm.bias.unsqueeze(1)
    if norm.training and norm.track_running_stats:
        with torch.no_grad():
            norm.num_batches_tracked.add_(1)
            if torch.compiler.is_compiling():  # the same in tensors: no value leaves the graph
                _update_running_traced(norm, mean.detach(), var.detach(), total)
            else:
                factor = norm.momentum if norm.momentum is not None else 1.0 / float(norm.num_batches_tracked)
                n = float(total)
                norm.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                norm.running_var.mul_(1 - factor).add_(var.detach() * (n / max(n - 1, 1.0)), alpha=factor)
    shape = (channels, x.shape[0]) + tuple(x.shape[2:])
    return out.reshape(shape).transpose(0, 1)


def _update_running_traced(norm, mean, var, total):
    """Move ``norm``'s running statistics by the batch's ``mean`` and ``var`` (of ``total`` elements, a tensor)."""
    if norm.momentum is not None:
        factor = norm.momentum
    else:
        factor = (1.0 / norm.num_batches_tracked.double()).to(mean.dtype)
    unbiased = var * (total / torch.clamp(total - 1, min=1.0)).to(var.dtype)
    norm.running_mean.mul_(1 - factor).add_(mean * factor)
    norm.running_var.mul_(1 - factor).add_(unbiased * factor)


class DomainParallelBatchNorm(Wrapper):
    """A ``torch.nn.BatchNorm2d``/``BatchNorm3d`` whose batch statistics are those of the whole (sharded) field.

    Collective over the domain group in training (or without running statistics), forward and
    backward: each rank passes its shard and gets its rows of the single-process output, and the
    running statistics move alike on every rank (see :func:`batch_norm`). In eval mode with running
    statistics it is local. Statistics span the domain group only, as on one process holding the
    whole field; data-parallel replicas keep their own (as ``torch.nn.BatchNorm`` does).

    :param norm: The BatchNorm; it keeps the parameters and buffers (``.norm``, same state_dict keys).
    :param shard_dim: The sharded dim (only recorded).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    _child = "norm"

    def __init__(self, norm, shard_dim=-2, manager=None):
        if not isinstance(norm, (torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)):
            raise TypeError(f"DomainParallelBatchNorm wraps a torch.nn.BatchNorm2d or BatchNorm3d, got "
                            f"{type(norm).__name__}")
        super().__init__(norm, shard_dim, manager)

    def forward(self, x):
        """Return this rank's rows of the batch-normalised whole field; collective in training."""
        x = self._pre_hooks(x)
        if x.ndim < 3 or x.shape[1] != self.norm.num_features:
            raise ValueError(f"DomainParallelBatchNorm expects (B, {self.norm.num_features}, ...) inputs, got shape "
                             f"{tuple(x.shape)}")
        return batch_norm(x, self.norm, self._manager())

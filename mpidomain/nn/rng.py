"""Random draws inside a converted model: each rank's own stream (``"tile"``) or one process's (``"one-process"``).

A converted model's elementwise dropout (``nn.Dropout``, ``nn.AlphaDropout``) and the attention-weight
dropout inside :class:`~mpidomain.nn.DomainParallelWindowAttention` draw in one of two ways, chosen by
``convert_to_domain_parallel(..., rng=...)``:

- ``"tile"`` (the default): each rank draws its shard's mask from its own stream: a generator seeded,
  at every call, from one number drawn from torch's default generator and the rank's place (its
  tensor- and domain-parallel ranks). Reproducible at a fixed layout; other masks than one process's.
- ``"one-process"``: every rank draws the whole field's mask from torch's default generator, in one
  process's order, and keeps its own part: bitwise one process's draw. It costs a whole field's
  mask per call, transient: the layer's activation on one process (and, for attention, one process's
  attention weights), and the time to draw it. On a GPU the mask is one process's (torch's fused kernel
  on the whole field) and the product is rounded once more (checked on CPU only).

In both modes torch's default generator advances alike on every rank of a domain group, so what the
model draws per sample (a DropPath's ``(B, 1, 1, 1)`` mask, noise of a latent vector) is the same on
every shard, as one process draws it. Everything here is local but :func:`field_slices` (one
agreement step and one small allgather per sharded dim).
"""

import math

import numpy as np
import torch

from .._validate import RNG_MODES, check_rng
from ..manager import sharded_dims
from ._shard import layer_extents

__all__ = ["RNG_MODES", "check_rng", "tile_generator", "dropout_draw", "field_slices"]

_SELU_ALPHA = 1.7580993408473766  # torch's alpha_dropout (SELU's alpha times its scale)


def tile_generator(manager, device):
    """Return a generator on ``device`` seeded from one draw of torch's default generator and this rank's place.

    Local. Every rank of a domain group draws the same number (their default generators agree), so the
    default generator stays alike on every rank; the place (tensor- and domain-parallel rank) makes
    each rank's stream its own.
    """
    seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
    state = np.random.SeedSequence([seed, manager.tp_rank, manager.domain_rank]).generate_state(1, np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state) & (2 ** 63 - 1))
    return generator


def dropout_draw(x, p, alpha, inplace, part=None, generator=None):
    """Return ``x`` dropped out as ``F.dropout`` (``alpha``: ``F.alpha_dropout``) in training mode drops it.

    ``part``: ``(global shape, part of it)``: the whole field's mask is drawn from torch's default
    generator, as one process draws it for a tensor of the global shape, and ``part(mask)`` is this
    rank's (slices, or an index). Otherwise the mask has ``x``'s shape, drawn from ``generator``. Local.
    """
    shape, select = part if part is not None else (x.shape, None)
    if p == 0 or math.prod(shape) == 0:
        return x
    if p == 1:
        return x.mul_(0.0) if inplace else x * 0.0
    if part is not None and not alpha and x.device.type != "cpu":  # torch's fused kernel, its Philox draws
        noise = torch.native_dropout(_empty_laid_out_as(x, shape).fill_(1), p, True)[0]
        noise = select(noise) if select is not None else noise
        return x.mul_(noise) if inplace else x * noise
    noise = _empty_laid_out_as(x, shape) if part is not None else torch.empty_like(x)
    noise.bernoulli_(1 - p, generator=generator)
    if select is not None:
        noise = select(noise)
    if alpha:  # torch's _dropout_impl, alpha branch
        a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
        shift = noise.add(-1).mul_(_SELU_ALPHA * a).add_(_SELU_ALPHA * a * p)
        noise.mul_(a)
        return (x.mul_(noise) if inplace else x * noise).add_(shift)
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


def _empty_laid_out_as(x, shape):
    """An empty tensor of ``shape`` whose dims lie in memory in the order ``torch.empty_like(x)``'s do.

    Torch's dropout draws its mask into ``empty_like(input)`` (the input's strides where it is dense), in memory
    order: one process's whole-field input has the shard's layout, so its mask is drawn in this order.
    """
    template = torch.empty_like(x, device="meta")
    order = sorted(range(x.ndim), key=lambda d: -template.stride(d))  # outermost first; stable on ties
    noise = torch.empty([shape[d] for d in order], dtype=x.dtype, device=x.device)
    return noise.permute([order.index(d) for d in range(x.ndim)])


def field_slices(manager, name, x, settings):
    """Return (the whole field's shape, this rank's slices of it) for a shard ``x`` of the manager's layout.

    Collective over the domain group: one agreement step and one allgather of two integers per sharded dim.
    """
    shape, index = list(x.shape), [slice(None)] * x.ndim
    for s in sharded_dims(manager, x.ndim):
        if s.parts > 1:
            extents, coord = layer_extents(manager, name, x, s.dim, settings)
            start = sum(extents[:coord])
            shape[s.dim], index[s.dim] = sum(extents), slice(start, start + extents[coord])
    return tuple(shape), tuple(index)

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
  attention weights), and the time to draw it. On a GPU the mask is the one torch's fused kernel draws for
  the whole field (written from torch's source; checked on CPU only).

In both modes torch's default generator advances alike on every rank of a domain group, so what the
model draws per sample (a DropPath's ``(B, 1, 1, 1)`` mask, noise of a latent vector) is the same on
every shard, as one process draws it. Everything here is local but :func:`field_slices` and
:func:`memory_order` (an agreement step and small allgathers).
"""

import math

import numpy as np
import torch

from .._validate import RNG_MODES, check_rng
from .._waits import allgather_ints
from ..manager import library_comm, sharded_dims
from ._compile_marks import compile_disabled
from . import plans
from ._shard import layer_extents

__all__ = ["RNG_MODES", "check_rng", "tile_generator", "tile_dropout", "dropout_draw", "field_slices",
           "memory_order"]

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


@compile_disabled
def tile_dropout(x, p, alpha, inplace, manager):
    """Return ``x`` dropped out with a mask of its own shape from this rank's stream (:func:`tile_generator`).

    Local. Left out of ``torch.compile``'s graph (a generator cannot be traced): a compiled model breaks its
    graph there, so ``fullgraph=True`` needs ``rng="one-process"`` or ``p = 0``.
    """
    if p == 0 or x.numel() == 0:
        return x
    return _dropped(x, p, alpha, inplace, torch.empty_like(x), tile_generator(manager, x.device))


def dropout_draw(x, p, alpha, inplace, shape, select, order):
    """Return ``x`` dropped out with this rank's part of the mask one process draws for the whole field.

    ``shape``: the whole field's; ``select(mask)``: this rank's part (slices, or an index); ``order``: the dims
    in one process's memory order (:func:`memory_order`). The mask is drawn from torch's default generator as
    torch's dropout (``alpha``: alpha dropout; ``inplace``: ``dropout_``) draws it in training mode for an input
    of ``shape`` laid out so, and the generator advances as on one process. Local.
    """
    if p == 0 or math.prod(shape) == 0:
        return x
    if p == 1:
        return x.mul_(0.0) if inplace else x * 0.0
    if not alpha and not inplace and x.device.type != "cpu":  # torch's fused kernel: its Philox draws
        mask = torch.native_dropout(_empty_laid_out(x, shape, order).fill_(1), p, True)[1]
        compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        return (x.to(compute) * select(mask).to(compute) * (1.0 / (1.0 - p))).to(x.dtype)
    noise = select(_empty_laid_out(x, shape, order).bernoulli_(1 - p))
    return _dropped(x, p, alpha, inplace, noise, None)


def _dropped(x, p, alpha, inplace, noise, generator):
    """torch's ``_dropout_impl``, from ``bernoulli_(1 - p)`` on: ``noise`` drawn here if ``generator`` is given."""
    if generator is not None:
        noise.bernoulli_(1 - p, generator=generator)
    if alpha:
        a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
        shift = noise.add(-1).mul_(_SELU_ALPHA * a).add_(_SELU_ALPHA * a * p)
        noise.mul_(a)
        return (x.mul_(noise) if inplace else x * noise).add_(shift)
    noise.div_(1 - p)
    return x.mul_(noise) if inplace else x * noise


def _empty_laid_out(x, shape, order):
    """An empty tensor of ``shape`` (``x``'s dtype and device) whose dims lie in memory in ``order``."""
    noise = torch.empty([shape[d] for d in order], dtype=x.dtype, device=x.device)
    return noise.permute([order.index(d) for d in range(x.ndim)])


def memory_order(manager, name, x, spread):
    """Return ``x``'s dims in the memory order of one process's input of the whole field, outermost first.

    Torch's dropout draws its mask into ``empty_like(input)`` (the input's strides where it is dense), in memory
    order, so one process's mask follows its input's layout; each rank's shard has that layout. A dim of one
    element has no place of its own in memory (its stride is arbitrary): a rank whose dims ``spread`` (those
    the ranks hold parts of) all have more than one element reads the order from its strides, and every rank
    takes the first such rank's (rank 0's if none). Collective over the domain group: one allgather of a few
    integers (a constant of a compiled graph).
    """
    template = torch.empty_like(x, device="meta")
    order = sorted(range(x.ndim), key=lambda d: (-template.stride(d), d))
    known = all(x.shape[d] > 1 for d in spread)
    return plans.planned(manager, "memory_order", (name, int(known), tuple(order)))


def _agreed_order(manager, key):
    name, known, order = key
    rows = allgather_ints(library_comm(manager), (known,) + order, name)
    chosen = next((row for row in rows if row[0]), rows[0])
    return list(chosen[1:])


plans.register_gather("memory_order", _agreed_order)


def field_slices(manager, name, x, settings):
    """Return (the whole field's shape, this rank's slices of it, one process's memory order of its dims) for a
    shard ``x`` of the manager's layout.

    Collective over the domain group: one agreement step and one allgather of two integers per sharded dim,
    and :func:`memory_order`'s allgather.
    """
    shape, index, spread = list(x.shape), [slice(None)] * x.ndim, []
    for s in sharded_dims(manager, x.ndim):
        if s.parts > 1:
            extents, coord = layer_extents(manager, name, x, s.dim, settings)
            start = sum(extents[:coord])
            shape[s.dim], index[s.dim] = sum(extents), slice(start, start + extents[coord])
            spread.append(s.dim)
    return tuple(shape), tuple(index), memory_order(manager, name, x, spread)

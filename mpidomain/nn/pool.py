"""Pooling over a sharded field, equal to the single-process pool in forward and backward.

- :class:`DomainParallelMaxPool2d`, :class:`DomainParallelAvgPool2d`: a pool is a
  convolution-like window, so a rank computes the output rows whose first input
  row lies in its own rows (:func:`mpidomain.nn.rows.pool_windows`), from its
  rows and its neighbours' (one differentiable halo exchange). Rows beyond the
  field are the pool's padding: ``-inf`` for max, and for average they count in
  the divisor as PyTorch counts them (``count_include_pad``, ``ceil_mode``,
  ``divisor_override``).
- :class:`DomainParallelAdaptiveAvgPool2d`, :class:`DomainParallelAdaptiveMaxPool2d`:
  an output's bin may span several ranks, so each rank pools the part of every
  bin it holds and one differentiable all-reduce (sum or max) over the domain
  group completes them. A rank keeps the outputs whose bin's first row lies in
  its rows; a global pool (output size 1 along a sharded dim) is the same on
  every rank (replicated, not a shard).
"""

import torch
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from ..reduce import allreduce
from . import rows
from ._shard import Wrapper, fetch_rows, layer_extents, require_covered, shard_dims, spatial_axis
from .conv import _check_windows
from .overlap import overlapped_rows, resolve
from .precision import float32_work

__all__ = ["DomainParallelAdaptiveAvgPool2d", "DomainParallelAdaptiveMaxPool2d", "DomainParallelAvgPool2d",
           "DomainParallelMaxPool2d", "adaptive_pool"]


class _Pool(Wrapper):
    """What every pool wrapper shares: the wrapped pool (``.pool``), checked for type and for indices."""

    _child = "pool"
    _base = ()

    def __init__(self, pool, shard_dim=-2, manager=None):
        if not isinstance(pool, self._base):
            raise TypeError(f"{type(self).__name__} wraps a torch.nn.{self._base.__name__}, got {type(pool).__name__}")
        if getattr(pool, "return_indices", False):
            raise ValueError(f"{type(self).__name__} cannot return indices: they would be local to each shard; "
                             "build the pool with return_indices=False")
        super().__init__(pool, shard_dim, manager)


class _WindowPool(_Pool):
    def __init__(self, pool, shard_dim=-2, manager=None, *, overlap=None):
        super().__init__(pool, shard_dim, manager)
        # True: start the halo exchange, pool the rows that need no halo, then the edge rows
        # (mpidomain.nn.overlap); False: exchange, then pool; None: mpidomain.nn.overlap_default().
        self.overlap = overlap

    def _geometry(self):
        """(kernel, stride, dilation, padding) per spatial axis, and ceil_mode."""
        pool = self.pool
        stride = pool.stride if pool.stride is not None else pool.kernel_size
        dilation = getattr(pool, "dilation", 1)
        return (_pair(pool.kernel_size), _pair(stride), _pair(dilation), _pair(pool.padding)), pool.ceil_mode

    def _settings(self, axis):
        return (type(self.pool).__name__, repr(self.pool), axis, ("overlap", resolve(self.overlap)))

    def forward(self, x):
        """Return this rank's rows of the pooled whole field; collective over the domain group.

        With ``overlap``, the exchange along the last sharded dim travels while the rows that need no
        halo along it are pooled (:mod:`mpidomain.nn.overlap`).
        """
        name, manager = type(self).__name__, self._manager()
        (k, s, d, p), ceil = self._geometry()
        require_covered(manager, x, self.shard_dim, 2, name, lambda a: k[a] == 1 and s[a] == 1 and p[a] == 0)
        overlap = resolve(self.overlap)
        cuts = []  # (dim, axis, window, total rows) per sharded dim
        dims = shard_dims(self.shard_dim)
        for i, shard_dim in enumerate(dims):
            dim, axis = spatial_axis(x, shard_dim, 2, name)
            extents, index = layer_extents(manager, name, x, dim, self._settings(axis))
            windows = rows.pool_windows(extents, k[axis], s[axis], d[axis], p[axis], ceil)
            halo = rows.halo_for(windows)
            details = (f"kernel={k[axis]}, stride={s[axis]}, dilation={d[axis]}, padding={p[axis]}, "
                       f"ceil_mode={ceil} along dim {dim}")
            _check_windows(name, windows, extents, halo, details)
            window, total = windows[index], sum(extents)
            if overlap and i == len(dims) - 1 and halo and window.outputs:
                done = list(cuts)
                return overlapped_rows(
                    x, window, halo, dim, manager,
                    lambda slab, sub: self._pool(slab, done + [(dim, axis, sub, total)], k, s, d, p, ceil),
                    s[axis], d[axis] * (k[axis] - 1) + 1)
            x = fetch_rows(x, window, halo, dim, manager)
            cuts.append((dim, axis, window, total))
        return self._pool(x, cuts, k, s, d, p, ceil)

    @staticmethod
    def _outside(x, dim, window, total):
        """A mask, broadcastable to ``x``, of the rows along ``dim`` beyond the field (the pool's padding)."""
        index = torch.arange(window.in_start, window.in_stop, device=x.device)
        shape = [1] * x.ndim
        shape[dim] = -1
        return ((index < 0) | (index >= total)).view(shape)


class DomainParallelMaxPool2d(_WindowPool):
    """A ``torch.nn.MaxPool2d`` on a field sharded along ``shard_dim`` (default -2, latitude); collective.

    Each rank passes its shard and gets its rows of the single-process output
    (rows dealt out by where their first input row lies, as for a convolution),
    forward and backward equal to the wrapped pool's: any kernel, stride,
    padding, dilation and ``ceil_mode``, uneven shards and tiles included.

    :param pool: The ``torch.nn.MaxPool2d`` (``return_indices=False``), kept as ``.pool``.
    :param shard_dim: The sharded dim of the input (the manager's ``shard_dim``), or ``(-2, -1)`` for tiles.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param overlap: True: pool the rows that need no halo while the halos travel; False: exchange, then pool;
        None (default): :func:`mpidomain.nn.overlap_default`. The results are the same either way.
    """

    _base = torch.nn.MaxPool2d

    def _pool(self, x, cuts, k, s, d, p, ceil):
        for dim, _, window, total in cuts:  # rows beyond the field never win a max
            if window.in_start < 0 or window.in_stop > total:
                x = x.masked_fill(self._outside(x, dim, window, total), float("-inf"))
        axes = [axis for _, axis, _, _ in cuts]
        padding = [0 if i in axes else p[i] for i in range(2)]
        return F.max_pool2d(x, k, s, padding, d, ceil_mode=ceil)


class DomainParallelAvgPool2d(_WindowPool):
    """A ``torch.nn.AvgPool2d`` on a field sharded along ``shard_dim``; collective, as :class:`DomainParallelMaxPool2d`.

    Each window's sum over the rows it holds, divided by PyTorch's divisor for
    that window: the rows and padding it covers (``count_include_pad``; a
    ``ceil_mode`` overhang never counts), or ``divisor_override``.
    """

    _base = torch.nn.AvgPool2d

    def _pool(self, x, cuts, k, s, d, p, ceil):
        dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):  # float32 work for half precision, as torch's kernel
            return self._average(float32_work(x), cuts, k, s, p, ceil).to(dtype)

    def _average(self, x, cuts, k, s, p, ceil):
        pool = self.pool
        axes = [axis for _, axis, _, _ in cuts]
        padding = [0 if i in axes else p[i] for i in range(2)]
        if pool.divisor_override:
            return F.avg_pool2d(x, k, s, padding, ceil, True, pool.divisor_override)
        local_n = {axis: x.shape[2 + axis] for axis in range(2) if axis not in axes}
        sums = F.avg_pool2d(x, k, s, padding, ceil, True, 1)
        divisor = None
        for axis in range(2):
            cut = [c for c in cuts if c[1] == axis]
            if cut:
                _, _, window, total = cut[0]
                outputs = range(window.out_start, window.out_stop)
            else:
                total = local_n[axis]
                outputs = range(sums.shape[2 + axis])
            counts = torch.tensor([self._count(o, k[axis], s[axis], p[axis], total, pool.count_include_pad)
                                   for o in outputs], dtype=sums.dtype, device=sums.device)
            counts = counts.view(-1, 1) if axis == 0 else counts.view(1, -1)
            divisor = counts if divisor is None else divisor * counts
        return sums / divisor

    @staticmethod
    def _count(o, kernel, stride, padding, total, include_pad):
        """PyTorch's count of output ``o``'s window along one dim of ``total`` rows."""
        start = o * stride - padding
        stop = min(start + kernel, total + padding)
        if include_pad:
            return stop - start
        return min(stop, total) - max(start, 0)


def _bin_parts(x, dim, bins, own_start, kind):
    """Pool each bin's rows that ``x`` (global rows from ``own_start``) holds along ``dim``: (..., len(bins), ...)."""
    n = x.shape[dim]
    fill = 0.0 if kind == "avg" else float("-inf")
    if all(bin_ == (i, i + 1) for i, bin_ in enumerate(bins)):  # a kept dim: each row its own bin
        shape = list(x.shape)
        shape[dim] = own_start
        before = x.new_full(shape, fill)
        shape[dim] = len(bins) - own_start - n
        return torch.cat([before, x, x.new_full(shape, fill)], dim)
    parts = []
    for start, stop in bins:
        lo, hi = max(start, own_start), min(stop, own_start + n)
        if hi > lo:
            piece = x.narrow(dim, lo - own_start, hi - lo)
            parts.append(piece.sum(dim, keepdim=True) if kind == "avg" else piece.amax(dim, keepdim=True))
        else:
            shape = list(x.shape)
            shape[dim] = 1
            parts.append(x.new_full(shape, fill))
    return torch.cat(parts, dim)


def adaptive_pool(x, output_size, kind, shard_dim, manager, name):
    """Return this rank's part of ``F.adaptive_{kind}_pool2d(whole field, output_size)``; differentiable.

    Collective over the domain group. Along a sharded dim a rank gets the
    outputs whose bin's first row lies in its rows, or the one output row of
    a global pool (size 1: the same on every rank); ``None`` keeps the rank's
    rows (local along that dim). Along other dims the pool is local.
    """
    sizes = list(_pair(output_size))
    settings = (name, kind, tuple(sizes))
    sharded = []  # (dim, axis, extents, index)
    for sd in shard_dims(shard_dim):
        dim, axis = spatial_axis(x, sd, 2, name)
        extents, index = layer_extents(manager, name, x, dim, settings)
        sharded.append((dim, axis, extents, index))
    dtype = x.dtype
    with torch.autocast(x.device.type, enabled=False):  # float32 work for half precision, as torch's kernels
        return _adaptive_parts(float32_work(x), sizes, kind, sharded, manager).to(dtype)


def _adaptive_parts(x, sizes, kind, sharded, manager):
    """:func:`adaptive_pool` once the extents are gathered (``sharded``: (dim, axis, extents, index) per dim)."""
    axes = [axis for _, axis, _, _ in sharded]
    pooled = F.adaptive_avg_pool2d if kind == "avg" else F.adaptive_max_pool2d
    local = [x.shape[2 + i] if (i in axes or sizes[i] is None) else sizes[i] for i in range(2)]
    if local != list(x.shape[2:]):
        x = pooled(x, local)
    if all(sizes[axis] is None for axis in axes):
        return x
    divisor = None
    keep = []
    for dim, axis, extents, index in sharded:
        total = sum(extents)
        m = total if sizes[axis] is None else sizes[axis]
        bins = rows.adaptive_bins(total, m)
        own_start = sum(extents[:index])
        x = _bin_parts(x, dim, bins, own_start, kind)
        keep.append((dim, rows.adaptive_windows(extents, m)[index]))
        if kind == "avg":
            counts = torch.tensor([b - a for a, b in bins], dtype=x.dtype, device=x.device)
            shape = [1] * x.ndim
            shape[dim] = -1
            divisor = counts.view(shape) if divisor is None else divisor * counts.view(shape)
    x = allreduce(x, "sum" if kind == "avg" else "max", "domain", manager)
    if divisor is not None:
        x = x / divisor
    for dim, (lo, hi) in keep:
        x = x.narrow(dim, lo, hi - lo)
    return x


class _AdaptivePool(_Pool):
    _kind = ""

    def forward(self, x):
        """Return this rank's part of the pooled whole field (see the class docstring); collective."""
        name, manager = type(self).__name__, self._manager()
        sizes = _pair(self.pool.output_size)
        require_covered(manager, x, self.shard_dim, 2, name, lambda a: sizes[a] is None)
        return adaptive_pool(x, self.pool.output_size, self._kind, self.shard_dim, manager, name)


class DomainParallelAdaptiveAvgPool2d(_AdaptivePool):
    """A ``torch.nn.AdaptiveAvgPool2d`` on a field sharded along ``shard_dim``; collective, forward and backward.

    Every rank gets the outputs whose bin's first input row lies in its rows;
    along a sharded dim pooled to size 1 (``AdaptiveAvgPool2d(1)``, a global
    mean) every rank gets the one row: the output is replicated, the same on
    every rank, and a loss computed from it on every rank counts once per rank
    (divide it by the domain size, or take it on one rank). ``None`` keeps a
    dim local. One all-reduce of the (B, C, *output_size) partial sums.

    :param pool: The ``torch.nn.AdaptiveAvgPool2d``, kept as ``.pool``.
    :param shard_dim: The sharded dim of the input (the manager's), or ``(-2, -1)`` for tiles.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    _base = torch.nn.AdaptiveAvgPool2d
    _kind = "avg"


class DomainParallelAdaptiveMaxPool2d(_AdaptivePool):
    """A ``torch.nn.AdaptiveMaxPool2d`` on a sharded field; as :class:`DomainParallelAdaptiveAvgPool2d`.

    One max all-reduce of the partial maxima; the gradient goes to the rank holding the maximum.
    """

    _base = torch.nn.AdaptiveMaxPool2d
    _kind = "max"


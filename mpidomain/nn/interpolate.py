"""Interpolation (resampling) of a sharded field, equal to ``F.interpolate`` on the whole field.

Along the sharded dim each output row is a weighted sum of a few input rows
(two for linear, one for nearest, four for cubic). The taps and weights are
PyTorch's own, read off ``F.interpolate`` of an identity matrix in the
input's dtype, so the rows and weights match the single-process call; the
other dims are interpolated by ``F.interpolate`` itself. ``size`` and
``scale_factor`` mean what they mean for the whole field.
"""

import functools

import torch
import torch.nn.functional as F

from ._compile_marks import constant_result
from . import rows
from .precision import float32_work, work_dtype
from ._shard import fetch_rows, layer_extents, require_covered, shard_dims, spatial_axis

__all__ = ["DomainParallelInterpolate"]

_ONE_D = {"linear": "linear", "bilinear": "linear", "trilinear": "linear", "nearest": "nearest",
          "nearest-exact": "nearest-exact", "area": "area", "bicubic": "bicubic"}


def _per_dim(value, spatial, name):
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != spatial:
            raise ValueError(f"{name} needs {spatial} values for a field with {spatial} spatial dims, got {value!r}")
        return tuple(value)
    return (value,) * spatial


@functools.lru_cache(maxsize=64)
def _taps(n, size, scale, mode, align_corners, recompute, dtype):
    """Return (indices, weights, output rows) of PyTorch's 1-D resampling of ``n`` rows: (M, K) tensors."""
    one_d = _ONE_D[mode]
    eye = torch.eye(n, dtype=dtype)
    kwargs = dict(mode=one_d, recompute_scale_factor=recompute)
    if one_d in ("linear", "bicubic"):
        kwargs["align_corners"] = align_corners
    if one_d == "bicubic":
        out = F.interpolate(eye.reshape(n, 1, n, 1), size=None if size is None else (size, 1),
                            scale_factor=None if scale is None else (scale, 1.0), **kwargs)[:, 0, :, 0]
    else:
        out = F.interpolate(eye.reshape(n, 1, n), size=size, scale_factor=scale, **kwargs)[:, 0, :]
    matrix = out.t()  # (M, n): output row o = sum_i matrix[o, i] * input row i
    width = max(1, int((matrix != 0).sum(1).max())) if matrix.numel() else 1
    indices = torch.zeros(matrix.shape[0], width, dtype=torch.long)
    weights = torch.zeros(matrix.shape[0], width, dtype=dtype)
    for o in range(matrix.shape[0]):
        taps = torch.nonzero(matrix[o]).flatten()
        if not len(taps):
            taps = torch.tensor([0])
        indices[o, :len(taps)] = taps
        indices[o, len(taps):] = taps[0]
        weights[o, :len(taps)] = matrix[o, taps]
    return indices, weights, matrix.shape[0]


@constant_result
def _resampling(extents, size, scale, mode, align_corners, recompute, dtype):
    """Return (indices, weights, every shard's window, the halo) along one dim of ``extents``: :func:`_taps`
    and :func:`_windows`, a constant of a compiled graph (Dynamo calls it at trace time). Local."""
    indices, weights, m = _taps(sum(extents), size, scale, mode, align_corners, recompute, dtype)
    windows = tuple(_windows(extents, indices, m))
    return indices, weights, windows, rows.halo_for(windows)


def _windows(extents, indices, m):
    """Each shard's window: the output rows whose first tap falls in its rows, and the input rows they tap."""
    n = sum(extents)
    starts = [sum(extents[:r]) for r in range(len(extents))]
    windows = []
    for r, (a, count) in enumerate(zip(starts, extents)):
        lo = 0 if r == 0 else rows.ceil_div(a * m, n)
        hi = m if r == len(extents) - 1 else rows.ceil_div((a + count) * m, n)
        taps = indices[lo:hi]
        first, stop = (int(taps.min()), int(taps.max()) + 1) if hi > lo else (a, a)
        windows.append(rows.Window(lo, hi, first, stop, a, a + count))
    return windows


class DomainParallelInterpolate(torch.nn.Module):
    """``F.interpolate`` (``torch.nn.Upsample``) of a field sharded along ``shard_dim``; collective.

    Each rank passes its shard and gets its rows of the single-process
    result: output rows ``[ceil(a*M/N), ceil(b*M/N))`` for its input rows
    ``[a, b)`` of ``N`` (``M`` output rows). Differentiable; exact in every
    mode ``F.interpolate`` has but ``antialias``.

    :param size: The whole field's output size (int or one per spatial dim), as for ``F.interpolate``.
    :param scale_factor: Or the scale (float or one per spatial dim).
    :param mode: ``"nearest"``, ``"nearest-exact"``, ``"linear"``, ``"bilinear"``, ``"bicubic"``, ``"trilinear"``, ``"area"``.
    :param align_corners: As for ``F.interpolate``.
    :param recompute_scale_factor: As for ``F.interpolate``.
    :param shard_dim: The sharded dim (the manager's ``shard_dim``).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, size=None, scale_factor=None, mode="nearest", align_corners=None, *,
                 recompute_scale_factor=None, shard_dim=-2, manager=None):
        super().__init__()
        if (size is None) == (scale_factor is None):
            raise ValueError("DomainParallelInterpolate needs exactly one of size and scale_factor")
        if mode not in _ONE_D:
            raise ValueError(f"mode must be one of {tuple(_ONE_D)}, got {mode!r}")
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor
        self.shard_dim, self.manager = shard_dim, manager

    @classmethod
    def from_upsample(cls, upsample, shard_dim=-2, manager=None):
        """Return the domain-parallel twin of ``torch.nn.Upsample`` module ``upsample``."""
        return cls(upsample.size, upsample.scale_factor, upsample.mode, upsample.align_corners,
                   recompute_scale_factor=upsample.recompute_scale_factor, shard_dim=shard_dim, manager=manager)

    def forward(self, x):
        """Return this rank's rows of the interpolated whole field; collective over the domain group.

        With tiles, the input rows along each sharded dim in turn, then the taps along each.
        """
        from .._current import require_manager

        name = "DomainParallelInterpolate"
        manager = require_manager(self.manager, name)
        spatial = x.ndim - 2
        size, scale = _per_dim(self.size, spatial, "size"), _per_dim(self.scale_factor, spatial, "scale_factor")
        settings = (size, scale, self.mode, self.align_corners, self.recompute_scale_factor)
        require_covered(manager, x, self.shard_dim, spatial, name,
                        lambda a: size is None and scale[a] == 1)
        along = []  # (dim, window, indices, weights) per sharded dim
        for shard_dim in shard_dims(self.shard_dim):
            dim, axis = spatial_axis(x, shard_dim, spatial, name)
            extents, index = layer_extents(manager, name, x, dim, settings)
            indices, weights, windows, halo = _resampling(tuple(extents), None if size is None else size[axis],
                                                    None if scale is None else scale[axis], self.mode,
                                                    self.align_corners, self.recompute_scale_factor,
                                                    work_dtype(x.dtype))
            if halo > min(extents):
                raise ValueError(f"{name}({settings}) needs {halo} rows of each neighbour, more than the smallest "
                                 f"shard of {list(extents)} holds; use fewer domain ranks")
            x = fetch_rows(x, windows[index], halo, dim, manager)
            along.append((dim, axis, windows[index], indices, weights))
        dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):  # float32 work for half precision, as torch's kernels
            return self._resample(float32_work(x), along, size, scale, spatial).to(dtype)

    def _resample(self, x, along, size, scale, spatial):
        """The resampling of the fetched rows ``x``: ``F.interpolate`` along local dims, the taps along ``along``."""
        axes = [axis for _, axis, _, _, _ in along]
        others = dict(mode=self.mode, recompute_scale_factor=self.recompute_scale_factor)
        if self.mode in ("linear", "bilinear", "bicubic", "trilinear"):
            others["align_corners"] = self.align_corners
        if size is not None:
            target = tuple(x.shape[2 + i] if i in axes else size[i] for i in range(spatial))
            if target != tuple(x.shape[2:]):
                x = F.interpolate(x, size=target, **others)
        elif any(scale[i] != 1 for i in range(spatial) if i not in axes):
            x = F.interpolate(x, scale_factor=tuple(1.0 if i in axes else scale[i] for i in range(spatial)), **others)
        for dim, _, window, indices, weights in along:
            x = self._taps_along(x, dim, window, indices, weights)
        return x

    def _taps_along(self, slab, dim, window, indices, weights):
        """The weighted sums of ``slab``'s rows (global ``window.in_start`` on) that make this rank's output rows."""
        local = (indices[window.out_start:window.out_stop] - window.in_start).to(slab.device)
        taps_weights = weights[window.out_start:window.out_stop].to(slab.device)
        shape = [1] * slab.ndim
        shape[dim] = -1
        out = None
        for k in range(local.shape[1]):
            term = slab.index_select(dim, local[:, k])
            if self.mode not in ("nearest", "nearest-exact"):
                term = term * taps_weights[:, k].view(shape)
            out = term if out is None else out + term
        return out

    def extra_repr(self):
        what = f"size={self.size}" if self.size is not None else f"scale_factor={self.scale_factor}"
        return f"{what}, mode={self.mode!r}, shard_dim={self.shard_dim}"

"""The global reference of the tests: one field, padded in one piece, cut to the tile of a rank.

- :func:`global_field`: the same random field on every rank, from a shape and a seed;
- :func:`global_pad`: that field padded along some dims with the library's boundary modes
  (``"zeros"``, ``"periodic"``, ``"fold"``: the pole fold of the Earth, half a turn along the next dim);
- :func:`pad_along`, :func:`padded_rows`: the same along one dim, and the rows of one shard with its halos;
- :func:`earth_pad`: CREDIT's ``TensorPadding(mode="earth")``, rewritten with its torch ops;
- :func:`bounds`, :func:`window`, :func:`tile_of`: the rows of a rank (``balanced_split``), and the tile of
  this rank of the manager in the field or, widened by its halos, in the padded field.
"""

import numpy as np

from mpidomain.layout.tiles import balanced_split


def global_field(shape, seed=0, dtype=np.float64, int_scale=1000):
    """A standard normal field of ``shape`` from ``seed``, as ``dtype`` (integers: scaled by ``int_scale`` first)."""
    values = np.random.default_rng(seed).standard_normal(shape)
    return values.astype(dtype) if np.dtype(dtype).kind in "fc" else (values * int_scale).astype(dtype)


def global_pad(field, dims, widths, modes, turn=True):
    """The NumPy ``field`` padded along ``dims`` in order by ``widths`` rows on both sides, per ``modes``.

    ``"zeros"``, ``"periodic"`` (wrapped rows) or ``"fold"``: beyond a pole the rows on the near side,
    flipped and turned half way along the next of ``dims`` (``turn=False`` leaves the turn out: the
    deliberately wrong reference of a negative control).
    """
    dims = [d % field.ndim for d in dims]
    for k, (d, h, mode) in enumerate(zip(dims, widths, modes)):
        if mode == "fold":
            turned = np.roll(field, field.shape[dims[k + 1]] // 2, axis=dims[k + 1]) if turn else field
            n = field.shape[d]
            top = np.flip(np.take(turned, range(h), axis=d), d)
            bottom = np.flip(np.take(turned, range(n - h, n), axis=d), d)
            field = np.concatenate([top, field, bottom], axis=d)
        elif mode in ("zeros", "periodic"):
            spec = [(0, 0)] * field.ndim
            spec[d] = (h, h)
            field = np.pad(field, spec, mode="wrap" if mode == "periodic" else "constant")
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return field


def earth_pad(x, h, w, turn=True):
    """CREDIT's ``TensorPadding(mode="earth", pad_lat=(h, h), pad_lon=(w, w)).pad(x)``, rewritten with its torch ops.

    ``turn=False`` leaves out the half turn: the deliberately wrong reference of the negative control.
    """
    import torch

    W = x.shape[-1]
    xroll = torch.roll(x, W // 2, dims=-1) if turn else x
    top = torch.flip(xroll[..., :h, :], dims=[-2])
    bottom = torch.flip(xroll[..., -h:, :], dims=[-2])
    x = torch.cat([top, x, bottom], dim=-2)
    # CREDIT pads (B, C, H, W) with (w, w, 0, 0); circular padding of a 5-D input takes three dims' pads.
    return torch.nn.functional.pad(x, (w, w) + (0, 0) * (x.ndim - 3), mode="circular")


def bounds(extent, parts, index):
    """Start and length of the rows of part ``index`` of ``extent`` rows split over ``parts``: the first
    ``extent % parts`` parts get one more (``balanced_split``)."""
    counts, offsets = balanced_split(extent, parts)
    return offsets[index], counts[index]


def window(manager, shape, halo=0, dims=None):
    """The index of this rank's tile of a field of ``shape``, widened by ``halo`` rows (in the padded field).

    ``dims`` (default: the manager's ``shard_dims``) are the dims to cut, each with a ``halo`` width (an int:
    the same for all); a dim the manager does not shard is kept whole (with its halos).
    """
    shard_dims = [d % len(shape) for d in manager.shard_dims]
    dims = manager.shard_dims if dims is None else dims
    dims = [d % len(shape) for d in dims]
    halo = (halo,) * len(dims) if isinstance(halo, int) else tuple(halo)
    spans = [slice(None)] * len(shape)
    for d, h in zip(dims, halo):
        if d in shard_dims:
            k = shard_dims.index(d)
            start, count = bounds(shape[d], manager.domain_shape[k], manager.domain_coords[k])
        else:
            start, count = 0, shape[d]
        spans[d] = slice(start, start + count + 2 * h)
    return tuple(spans)


def tile_of(field, manager, halo=0, dims=None):
    """This rank's tile of ``field`` (NumPy or torch; a view), or with ``halo`` of the field padded by ``halo``."""
    shape = tuple(field.shape)
    if halo:
        dims_ = manager.shard_dims if dims is None else dims
        widths = (halo,) * len(dims_) if isinstance(halo, int) else tuple(halo)
        shape = list(shape)
        for d, h in zip(dims_, widths):
            shape[d] -= 2 * h
    return field[window(manager, tuple(shape), halo, dims)]


def padded_rows(field, dim, h, periodic, start, n):
    """Rows ``start - h`` to ``start + n + h`` along ``dim`` of ``field`` padded globally with zeros or wrapped rows."""
    return np.take(pad_along(field, dim, h, periodic), range(start, start + n + 2 * h), axis=dim % field.ndim)


def pad_along(field, dim, h, periodic=False):
    """``field`` padded with ``h`` zero (or wrapped) rows on both sides along ``dim``."""
    return global_pad(field, (dim,), (h,), ("periodic" if periodic else "zeros",))

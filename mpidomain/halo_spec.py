"""What one rank's halo exchange is, from its arguments, and the checks the domain group agrees on.

:class:`HaloSpec` is built once per call (:func:`describe`; local, raising
TypeError/ValueError for a local mistake); its :meth:`~HaloSpec.signature` is what
every rank must pass alike (one agreement step); the extent checks gather each
rank's extents and raise alike on every rank. No plan, no buffers: the engine
(:mod:`mpidomain.halo`) builds on a spec the ranks agreed on.
"""

import dataclasses

import numpy as np

from . import devices
from ._mpi import agree
from ._validate import normalize_dim, require_int

__all__ = ["HaloSpec", "describe", "group_mismatch", "agree_inputs", "check_extents", "check_tiles"]

_NUMBER_KINDS = "biufc"  # bool, signed, unsigned, float, complex


@dataclasses.dataclass(frozen=True)
class HaloSpec:
    """What one rank's exchange is, built once per call from its arguments (:func:`describe`).

    ``dim``, ``halo_width`` and ``boundaries`` are per dim of the exchange's grid
    (tuples) for a :class:`~mpidomain.tile_layout.TileLayout`; for a slab
    (:class:`~mpidomain.halo_layout.HaloLayout`) ``dim`` and ``halo_width`` are
    ints, ``periodic`` a bool and ``boundaries`` None. ``extent`` (the local
    extent along ``dim``) may differ between ranks; the rest may not.
    """

    array: str
    dtype: object
    ndim: int
    dim: object
    other_extents: tuple
    halo_width: object
    periodic: object = None
    boundaries: object = None
    boundary: object = None
    extent: object = None

    @property
    def tiled(self):
        """True for a :class:`~mpidomain.tile_layout.TileLayout` exchange (tiles, several dims, the Earth)."""
        return self.boundaries is not None

    def signature(self):
        """What every rank of the group must pass alike, by field name as the error messages spell it."""
        names = ["array", "dtype", "ndim", "dim", "other_extents", "halo_width"]
        names += ["boundaries", "boundary"] if self.tiled else ["periodic"]
        return {name.replace("_extents", " extents"): getattr(self, name) for name in names}

    def padded_shape(self, shape):
        """``shape`` with the halos added."""
        dims, widths = (self.dim, self.halo_width) if self.tiled else ((self.dim,), (self.halo_width,))
        padded = list(shape)
        for d, h in zip(dims, widths):
            padded[d] += 2 * h
        return tuple(padded)


def _is_tiled(manager, halo_width, dim, periodic, boundary):
    """True if the exchange is a :class:`~mpidomain.tile_layout.TileLayout`'s: tiles, several dims or a boundary."""
    return (len(manager.shard_dims) > 1 or boundary is not None
            or any(isinstance(a, (tuple, list)) for a in (halo_width, dim, periodic)))


def describe(x, halo_width, dim, periodic, manager, boundary=None):
    """Return this rank's :class:`HaloSpec`, built from its arguments; raise TypeError/ValueError for a local mistake.

    The extents along ``dim`` and along the manager's ``shard_dim`` may differ between ranks
    (uneven shards, also when padding locally along another dim); the others may not.
    """
    kind = devices.array_kind(x)
    shape = tuple(int(n) for n in x.shape)
    if not shape:
        raise ValueError("x is a 0-d array; halo exchange needs at least the sharded dimension")
    dtype = devices.numpy_dtype(x)
    if dtype.kind not in _NUMBER_KINDS:
        raise TypeError(
            f"unsupported dtype {x.dtype} (NumPy kind {dtype.kind!r}); halo exchange moves numbers: "
            "use a bool, integer, float or complex array"
        )
    if _is_tiled(manager, halo_width, dim, periodic, boundary):
        return _describe_tiles(x, shape, halo_width, dim, periodic, manager, boundary)
    require_int("halo_width", halo_width, least=0, hint="pass the number of ghost rows on each side, e.g. 1")
    if not isinstance(periodic, (bool, np.bool_)):
        raise TypeError(f"periodic must be True or False, got {periodic!r} ({type(periodic).__name__})")
    dim = normalize_dim(manager.shard_dim if dim is None else dim, shape)
    shard_dim = manager.shard_dim
    sharded = shard_dim % len(shape) if -len(shape) <= shard_dim < len(shape) else None
    return HaloSpec(
        array=f"{kind} on {'device' if devices.is_device_array(x) else 'host'}",
        dtype=x.dtype,
        ndim=len(shape),
        dim=dim,
        other_extents=tuple(None if i in (dim, sharded) else n for i, n in enumerate(shape)),
        halo_width=int(halo_width),
        periodic=bool(periodic),
        extent=shape[dim],
    )


def _per_dim(name, value, count, check):
    """``value`` for each of ``count`` dims: one value for all, or a tuple of ``count``; each passed to ``check``."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * count
    if len(values) != count:
        raise ValueError(f"{name}={value!r} needs one value per dim of the exchange ({count}), or a single value")
    return tuple(check(v) for v in values)


def _is_bool(name):
    def check(value):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False (or one per dim), got {value!r} ({type(value).__name__})")
        return bool(value)
    return check


def _describe_tiles(x, shape, halo_width, dim, periodic, manager, boundary):
    """:func:`describe` for a :class:`~mpidomain.tile_layout.TileLayout` exchange."""
    ndim = len(shape)
    if boundary not in (None, "earth"):
        raise ValueError(f"boundary must be None or 'earth', got {boundary!r}")
    sharded = []
    for d, parts in zip(manager.shard_dims, manager.domain_shape):
        if -ndim <= d < ndim:
            sharded.append(d % ndim)
        elif parts > 1:
            raise ValueError(f"the manager shards dim {d}, which a {ndim}-d array of shape {shape} does not have; "
                             "pass arrays with the sharded dims")
    if dim is None:
        dim = (-2, -1) if boundary == "earth" else manager.shard_dims
    dims = tuple(normalize_dim(d, shape) for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim={dim!r} names a dim twice; pass distinct dims, e.g. (-2, -1)")
    widths = _per_dim("halo_width", halo_width, len(dims),
                      lambda h: require_int("halo_width", h, least=0, hint="ghost rows on each side, e.g. 1 or (1, 2)"))
    wraps = _per_dim("periodic", periodic, len(dims), _is_bool("periodic"))
    if boundary == "earth":
        if sorted(dims) != [ndim - 2, ndim - 1]:
            raise ValueError(f"boundary='earth' pads latitude and longitude, the last two dims (-2, -1) of x of shape "
                             f"{shape}, got dim={dim!r}; pass dim=None or dim=(-2, -1)")
        if any(wraps):
            raise ValueError("boundary='earth' sets both boundaries (longitude periodic, latitude folded across "
                             "the poles); drop periodic=")
        modes = {ndim - 2: "fold", ndim - 1: "periodic"}
    else:
        modes = {d: "periodic" if w else "zeros" for d, w in zip(dims, wraps)}
    grid = tuple(sorted(set(dims) | set(sharded)))
    width_of = dict(zip(dims, widths))
    return HaloSpec(
        array=f"{devices.array_kind(x)} on {'device' if devices.is_device_array(x) else 'host'}",
        dtype=x.dtype,
        ndim=ndim,
        dim=grid,
        other_extents=tuple(None if i in grid else n for i, n in enumerate(shape)),
        halo_width=tuple(width_of.get(d, 0) for d in grid),
        boundaries=tuple(modes.get(d, "zeros") for d in grid),
        boundary=boundary,
        extent=tuple(shape[d] for d in grid),
    )


def group_mismatch(everyone):
    """Return the TypeError/ValueError for the ranks' differing :meth:`HaloSpec.signature` dicts."""
    problems = []
    for field in everyone[0]:
        values = [e[field] for e in everyone]
        if any(v != values[0] for v in values):
            listing = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            problems.append(f"{field} must be the same on every rank of the domain group, got {listing}")
    kind = TypeError if problems[0].startswith(("array", "dtype", "call")) else ValueError
    return kind("halo exchange inputs disagree across the domain group:\n  " + "\n  ".join(problems))


def agree_inputs(comm, call, mine, error):
    """Agree on the ranks' :class:`HaloSpec` ``mine`` (None after a local ``error``) for ``call``, or raise on
    every rank; one Allreduce."""
    agree(comm, call, None if mine is None else mine.signature(), False, error, group_mismatch)


def check_extents(comm, mine):
    """Raise ValueError on every rank unless every rank holds at least ``halo_width`` rows; collective."""
    extents = comm.allgather(mine.extent)
    width = mine.halo_width
    if min(extents) < width:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(extents))
        raise ValueError(
            f"halo_width={width} exceeds the extent along dim on some ranks ({listing}); every rank "
            f"must hold at least {width} rows: use a smaller halo_width or fewer domain ranks"
        )


def check_tiles(comm, mine, manager):
    """Return each grid dim's tile extents, per coordinate; raise ValueError on every rank unless the
    ranks' tiles form a grid whose every tile holds at least its halo. Collective."""
    everyone = comm.allgather(mine.extent)
    grid, widths = mine.dim, mine.halo_width
    ndim = mine.ndim
    along = {d % ndim: k for k, d in enumerate(manager.shard_dims) if -ndim <= d < ndim}
    extents, problems = [], []
    for j, d in enumerate(grid):
        k = along.get(d)
        count = manager.domain_shape[k] if k is not None else 1
        sizes = [None] * count
        for rank, extent in enumerate(everyone):
            c = manager.domain_coords_of(rank)[k] if k is not None else 0
            if sizes[c] is None:
                sizes[c] = extent[j]
            elif sizes[c] != extent[j]:
                problems.append(f"the tiles at coordinate {c} along dim {d} differ in extent "
                                f"({', '.join(f'rank {r}: {e[j]}' for r, e in enumerate(everyone))}); every tile of "
                                "a row or column of the grid must have the same extent, as shard_tensor cuts them")
                break
        if widths[j] > min(s for s in sizes if s is not None):
            listing = ", ".join(f"rank {r}: {e[j]}" for r, e in enumerate(everyone))
            problems.append(f"halo_width={widths[j]} along dim {d} exceeds the tile extent there on some ranks "
                            f"({listing}); every tile must hold at least {widths[j]} rows: use a smaller halo or "
                            "fewer ranks along that dim")
        extents.append(tuple(sizes))
    if problems:
        raise ValueError("halo exchange on tiles: " + "; ".join(problems))
    coords = tuple(manager.domain_coords[along[d]] if d in along else 0 for d in grid)
    return tuple(extents), coords

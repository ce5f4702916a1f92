"""What one rank's halo exchange is, from its arguments, and the checks the domain group agrees on.

:class:`HaloSpec` is built once per call (:func:`describe`; local, raising
TypeError/ValueError for a local mistake), the same way for slabs, tiles and
the Earth: per dim of the exchange's grid (:class:`~mpidomain.layout.tiles.TileLayout`).
Its :meth:`~HaloSpec.signature` is what every rank must pass alike (one
agreement step); :func:`check_tiles` gathers each rank's extents and raises
alike on every rank. No plan, no buffers: the engine (:mod:`mpidomain.halo.plan`)
builds on a spec the ranks agreed on.
"""

import dataclasses

import numpy as np

from .. import devices
from .._waits import allgather_ints
from .._validate import normalize_dim, require_int
from ..manager import sharded_dims

__all__ = ["HaloSpec", "describe", "group_mismatch", "check_tiles"]

_NUMBER_KINDS = "biufc"  # bool, signed, unsigned, float, complex


def _one(values):
    """``values`` (a tuple, one per exchanged dim), or its single value for an exchange along one dim."""
    return values[0] if len(values) == 1 else values


@dataclasses.dataclass(frozen=True)
class HaloSpec:
    """What one rank's exchange is, built once per call from its arguments (:func:`describe`).

    ``dims`` is the exchange's grid (normalised, increasing): the dims it pads
    (``exchanged``) and the dims the manager shards; ``widths``, ``modes``
    (:data:`~mpidomain.layout.tiles.MODES`) and ``extents`` (this rank's, which
    may differ between ranks) have one entry per grid dim. ``other_extents``
    holds the extents of the other dims (None along the grid), which may not.
    """

    array: str
    dtype: object
    ndim: int
    dims: tuple
    widths: tuple
    modes: tuple
    exchanged: tuple
    boundary: object
    other_extents: tuple
    extents: tuple

    def arguments(self):
        """``(dim, halo_width, periodic)`` as the call passed them, normalised: one value per exchanged dim,
        the value itself for an exchange along one dim."""
        picked = [k for k, d in enumerate(self.dims) if d in self.exchanged]
        return (_one(self.exchanged), _one(tuple(self.widths[k] for k in picked)),
                _one(tuple(self.boundary is None and self.modes[k] == "periodic" for k in picked)))

    def signature(self):
        """What every rank of the group must pass alike, by field name as the error messages spell it."""
        dim, halo_width, periodic = self.arguments()
        return {"array": self.array, "dtype": self.dtype, "ndim": self.ndim, "dim": dim,
                "other extents": self.other_extents, "halo_width": halo_width, "periodic": periodic,
                "boundary": self.boundary}

    def padded_shape(self, shape):
        """``shape`` with the halos added."""
        padded = list(shape)
        for d, h in zip(self.dims, self.widths):
            padded[d] += 2 * h
        return tuple(padded)


def _per_dim(name, value, count, check):
    """``value`` for each of ``count`` dims: one value for all, or a tuple of ``count``; each passed to ``check``."""
    if not isinstance(value, (tuple, list)):
        return (check(value, ""),) * count
    if len(value) != count:
        raise ValueError(f"{name}={value!r} needs one value per dim of the exchange ({count}), or a single value")
    return tuple(check(v, " (or one per dim)") for v in value)


def _width(value, per_dim):
    hint = "ghost rows on each side, e.g. 1 or (1, 2)" if per_dim else "pass the number of ghost rows on each side, e.g. 1"
    return require_int("halo_width", value, least=0, hint=hint)


def _wraps(value, per_dim):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"periodic must be True or False{per_dim}, got {value!r} ({type(value).__name__})")
    return bool(value)


def describe(x, halo_width, dim, periodic, manager, boundary=None):
    """Return this rank's :class:`HaloSpec`, built from its arguments; raise TypeError/ValueError for a local mistake.

    ``dim`` (default: the manager's ``shard_dims``; ``(-2, -1)`` with the Earth) is one dim or a tuple;
    ``halo_width`` and ``periodic`` one value or one per dim. The extents along the grid's dims may
    differ between ranks (uneven shards, a local pad of each rank's own extent); the others may not.
    """
    kind = devices.array_kind(x)
    shape = tuple(int(n) for n in x.shape)
    ndim = len(shape)
    if not shape:
        raise ValueError("x is a 0-d array; halo exchange needs at least the sharded dimension")
    dtype = devices.numpy_dtype(x)
    if dtype.kind not in _NUMBER_KINDS:
        raise TypeError(
            f"unsupported dtype {x.dtype} (NumPy kind {dtype.kind!r}); halo exchange moves numbers: "
            "use a bool, integer, float or complex array"
        )
    if boundary not in (None, "earth"):
        raise ValueError(f"boundary must be None or 'earth', got {boundary!r}")
    if dim is None:
        dim = (-2, -1) if boundary == "earth" else manager.shard_dims
    dims = tuple(normalize_dim(d, shape) for d in (dim if isinstance(dim, (tuple, list)) else (dim,)))
    if len(set(dims)) != len(dims):
        raise ValueError(f"dim={dim!r} names a dim twice; pass distinct dims, e.g. (-2, -1)")
    widths = _per_dim("halo_width", halo_width, len(dims), _width)
    wraps = _per_dim("periodic", periodic, len(dims), _wraps)
    sharded = [s.dim for s in sharded_dims(manager, ndim)]
    for d, parts in zip(manager.shard_dims, manager.domain_shape):
        if parts > 1 and not -ndim <= d < ndim:  # a dim the manager splits that x lacks
            raise ValueError(f"the manager shards dim {d}, which a {ndim}-d array of shape {shape} does not have; "
                             "pass arrays with the sharded dims")
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
        array=f"{kind} on {'device' if devices.is_device_array(x) else 'host'}",
        dtype=x.dtype,
        ndim=ndim,
        dims=grid,
        widths=tuple(width_of.get(d, 0) for d in grid),
        modes=tuple(modes.get(d, "zeros") for d in grid),
        exchanged=tuple(sorted(dims)),
        boundary=boundary,
        other_extents=tuple(None if i in grid else n for i, n in enumerate(shape)),
        extents=tuple(shape[d] for d in grid),
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


def check_tiles(comm, mine, manager, call):
    """Return each grid dim's tile extents, per coordinate, and this rank's coordinates; collective.

    Raise ValueError on every rank unless the ranks' tiles form a grid (along a
    dim the manager shards, one extent per coordinate, uneven ones allowed:
    721 rows over 4 ranks are 181/180/180/180) whose every tile holds at least
    its halo. Along a dim the manager does not shard every rank holds all of
    it: where no rows travel between ranks (no halo along a sharded dim) each
    pads its own extent, else all ranks must share it.
    """
    everyone = allgather_ints(comm, mine.extents, call)
    along = {s.dim: s for s in sharded_dims(manager, mine.ndim)}
    travels = any(h for d, h in zip(mine.dims, mine.widths) if d in along)
    one = len(mine.exchanged) == 1
    extents, problems = [], []
    for j, d in enumerate(mine.dims):
        listing = ", ".join(f"rank {r}: {e[j]}" for r, e in enumerate(everyone))
        split = along.get(d)
        if split is None and not travels:  # a local pad: each rank's own extent
            sizes = [mine.extents[j]]
            smallest = min(e[j] for e in everyone)
        else:
            sizes = [None] * (split.parts if split is not None else 1)
            for rank, extent in enumerate(everyone):
                c = manager.domain_coords_of(rank)[split.axis] if split is not None else 0
                if sizes[c] is None:
                    sizes[c] = extent[j]
                elif sizes[c] != extent[j]:
                    problems.append(f"the tiles at coordinate {c} along dim {d} differ in extent ({listing}); every "
                                    "tile of a row or column of the grid must have the same extent, as shard_tensor "
                                    "cuts them")
                    break
            smallest = min(s for s in sizes if s is not None)
        h = mine.widths[j]
        if h > smallest:
            problems.append(
                f"halo_width={h} exceeds the extent along dim on some ranks ({listing}); every rank must hold at "
                f"least {h} rows: use a smaller halo_width or fewer domain ranks" if one else
                f"halo_width={h} along dim {d} exceeds the tile extent there on some ranks ({listing}); every tile "
                f"must hold at least {h} rows: use a smaller halo or fewer ranks along that dim")
        extents.append(tuple(sizes))
    if problems:
        raise ValueError(("" if one else "halo exchange on tiles: ") + "; ".join(problems))
    coords = tuple(along[d].coord if d in along else 0 for d in mine.dims)
    return tuple(extents), coords

"""Which rows and columns of the global field one rank's tile and its halos need: pure arithmetic.

A :class:`TileWindow` lists, for each padded row and column of this rank's
tile, the row or column of the global field it holds (-1: zeros), as
:class:`~mpidomain.layout.tiles.TileLayout` (the halo engine's arithmetic)
places them; so a tile read with its halos equals the tile read without, then
padded by :func:`mpidomain.halo_exchange`. No I/O, no MPI, no xarray.
"""

import functools
from dataclasses import dataclass
from typing import Tuple

from .._validate import is_int
from ..layout.tiles import TileLayout, balanced_split

__all__ = ["TileWindow", "tile_window"]


@dataclass(frozen=True)
class TileWindow:
    """One rank's tile of a ``shape`` (latitude, longitude) field and its halos.

    :param shape: The global field's (latitude, longitude) extents.
    :param grid: Tiles along latitude and longitude: ``(D, 1)`` for slabs.
    :param coords: This rank's tile, ``(i_lat, i_lon)``.
    :param halo: Ghost rows along latitude, ghost columns along longitude, on each side.
    :param modes: Per dim, ``"zeros"``, ``"periodic"`` or (latitude only) ``"fold"`` (the Earth's poles).
    """

    shape: Tuple[int, int]
    grid: Tuple[int, int]
    coords: Tuple[int, int]
    halo: Tuple[int, int]
    modes: Tuple[str, str]

    @functools.cached_property
    def _layout(self):
        extents = tuple(balanced_split(n, parts)[0] for n, parts in zip(self.shape, self.grid))
        tile = tuple(sizes[c] for sizes, c in zip(extents, self.coords))
        return TileLayout(tile, (0, 1), self.halo, self.modes, extents, self.coords)

    @functools.cached_property
    def rows(self):
        """The global row of each padded row (-1: zeros)."""
        return self._layout.global_rows(0)[0]

    @functools.cached_property
    def mirrored(self):
        """True for each padded row beyond a pole (its columns are :attr:`turned_columns`)."""
        return self._layout.global_rows(0)[1]

    @functools.cached_property
    def columns(self):
        """The global column of each padded column (-1: zeros)."""
        return self._layout.global_rows(1)[0]

    @functools.cached_property
    def turned_columns(self):
        """The global column of each padded column in a row beyond a pole: half a turn away."""
        if self.modes[0] != "fold":
            return self.columns
        return self._layout.global_rows(1, turned=True)[0]


def _pair(name, value, check):
    values = tuple(value) if isinstance(value, (tuple, list)) else None
    if values is not None and len(values) != 2:
        raise ValueError(f"{name}={value!r} must be one value or a pair (latitude, longitude)")
    return tuple(check(v) for v in values) if values is not None else check(value)


def _width(value):
    if not is_int(value) or value < 0:
        raise (TypeError if not is_int(value) else ValueError)(
            f"halo must be an int >= 0 or a pair of them (latitude, longitude), got {value!r}; e.g. halo=1 or (1, 2)")
    return int(value)


def _flag(value):
    if not isinstance(value, bool):
        raise TypeError(f"periodic must be True or False, or a pair of them, got {value!r} ({type(value).__name__})")
    return value


def tile_window(shape, grid, coords, halo=0, periodic=False, boundary=None):
    """Return the :class:`TileWindow` of tile ``coords`` of a ``grid``, halo settings spelled as :func:`mpidomain.halo_exchange`'s.

    ``grid`` and ``coords`` are a manager's ``domain_shape`` and
    ``domain_coords``: ``(D,)`` and ``(i,)`` for latitude slabs. As in
    ``halo_exchange``, an int ``halo`` pads latitude and longitude on tiles or with
    ``boundary="earth"``, latitude only on slabs; a pair
    pads each dim by its own width. ``periodic`` (one flag or a pair) wraps
    the padded dims; ``boundary="earth"`` folds latitude across the poles and
    wraps longitude. Raise TypeError/ValueError naming the fix. Local, pure.
    """
    if boundary not in (None, "earth"):
        raise ValueError(f"boundary must be None or 'earth', got {boundary!r}")
    slabs = len(grid) == 1
    grid, coords = (tuple(grid) + (1,), tuple(coords) + (0,)) if slabs else (tuple(grid), tuple(coords))
    halo, periodic = _pair("halo", halo, _width), _pair("periodic", periodic, _flag)
    if not isinstance(halo, tuple):
        halo = (halo, 0) if slabs and boundary is None else (halo, halo)
    if not isinstance(periodic, tuple):
        periodic = (periodic, periodic)
    if boundary == "earth":
        if any(periodic):
            raise ValueError("boundary='earth' sets both boundaries (longitude periodic, latitude folded across the "
                             "poles); drop periodic=")
        modes = ("fold", "periodic")
    else:
        modes = tuple("periodic" if p else "zeros" for p in periodic)
    for name, n, parts, h in zip(("latitude", "longitude"), shape, grid, halo):
        smallest = balanced_split(n, parts)[0][-1]
        if h > smallest:
            raise ValueError(f"halo={h} along {name} is wider than the smallest tile there ({n} split over {parts} "
                             f"ranks leaves {smallest}); every tile must hold at least its halo: use a smaller halo "
                             "or fewer ranks along that dim")
    return TileWindow(tuple(shape), grid, coords, halo, modes)

"""A small ERA5-like Zarr store made on the spot, written by tile: :func:`write_synthetic_store`.

Temperature and winds at two pressure levels plus two surface fields on a regular
latitude x longitude grid, six-hourly: smooth waves carried eastward at a speed that
falls off toward the poles, on realistic means. Every value is a product of factors
computed on the 1-D global axes, so each rank computes its own tile alone and the
store is the same bit for bit whatever the ranks' layout.
"""

import numpy as np
import xarray as xr

from .._waits import barrier
from ..data import write_tile
from ..manager import library_comm
from ..layout.tiles import balanced_split

__all__ = ["write_synthetic_store", "synthetic_layout", "SYNTHETIC_VARIABLES", "grid_coordinates"]

LEVELS = (500, 850)
# name: (long name, units, means at LEVELS or at the surface, amplitude)
SYNTHETIC_VARIABLES = {
    "t": ("temperature", "K", (252.0, 275.0), 6.0),
    "u": ("eastward wind", "m s-1", (12.0, 6.0), 8.0),
    "v": ("northward wind", "m s-1", (0.0, 0.0), 6.0),
    "t2m": ("2 metre temperature", "K", 285.0, 8.0),
    "sp": ("surface pressure", "Pa", 98000.0, 900.0),
}
WAVES = 3
CELLS_PER_STEP = 1.5  # eastward drift at the equator, in grid cells per time step


def synthetic_layout(variables=None):
    """The synthetic store's ``variables`` (default: all, by name) as the forecast lays out its channels:
    ``(name, levels or None)``, upper-air first, then surface; ValueError for a name it does not hold."""
    names = sorted(SYNTHETIC_VARIABLES) if variables is None else list(variables)
    unknown = [n for n in names if n not in SYNTHETIC_VARIABLES]
    if unknown:
        raise ValueError(f"--variables {','.join(names)}: {unknown} not in the synthetic store, whose variables are "
                         f"{list(SYNTHETIC_VARIABLES)}")
    upper = [(n, len(LEVELS)) for n in names if isinstance(SYNTHETIC_VARIABLES[n][2], tuple)]
    return upper + [(n, None) for n in names if not isinstance(SYNTHETIC_VARIABLES[n][2], tuple)]


def grid_coordinates(height, width):
    """Return (latitudes from north to south at cell centres, longitudes from 0 east), in degrees."""
    step = 180.0 / height
    latitude = 90.0 - step / 2 - step * np.arange(height)
    longitude = np.arange(width) * (360.0 / width)
    return latitude, longitude


def tile_bounds(manager, height, width):
    """Return this rank's (row slice, column slice) of a ``height`` x ``width`` grid in the manager's layout."""
    shape = manager.domain_shape if manager.tiled else (manager.domain_parallel_size, 1)
    coords = manager.domain_coords if manager.tiled else (manager.domain_coords[0], 0)
    bounds = []
    for extent, parts, index in ((height, shape[0], coords[0]), (width, shape[1], coords[1])):
        counts, offsets = balanced_split(extent, parts)
        bounds.append(slice(offsets[index], offsets[index] + counts[index]))
    return tuple(bounds)


def _field(rng, latitude, longitude, times, mean, amplitude, rows, columns):
    """One variable at one level on the tile (``times`` x rows x columns), float32."""
    lat = np.deg2rad(latitude)[:, None]                       # (H, 1) on the whole grid
    lon = np.deg2rad(longitude)                                # (W,)
    speed = CELLS_PER_STEP * (2 * np.pi / len(longitude)) * np.cos(lat)  # radians per step, (H, 1)
    t = np.arange(times)[None, :]                              # (1, T)
    field = np.zeros((times, rows.stop - rows.start, columns.stop - columns.start))
    for _ in range(WAVES):
        m, n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        a, phase = amplitude * rng.uniform(0.3, 1.0), rng.uniform(0, 2 * np.pi)
        envelope = (a * np.cos(lat) ** (2 * n))[rows, 0]                     # (h,)
        shift = m * speed * t                                                 # (H, T): each row's drift by step
        cos_shift, sin_shift = np.cos(shift)[rows].T, np.sin(shift)[rows].T    # (T, h)
        cos_lon, sin_lon = np.cos(m * lon + phase)[columns], np.sin(m * lon + phase)[columns]  # (w,)
        # cos(m lon + phase - shift), as products of the global axes' factors
        field += envelope[None, :, None] * (cos_shift[:, :, None] * cos_lon + sin_shift[:, :, None] * sin_lon)
    return (mean + field).astype(np.float32)


def write_synthetic_store(path, manager, grid=(128, 256), times=40, seed=0):
    """Write the synthetic store at ``path`` by tile; return its variable names.

    Collective over every rank of ``manager``: the first domain group writes (each rank its tile,
    with :func:`mpidomain.data.write_tile`), the other groups wait for it. Chunked by one time step
    and the writers' tiles.
    """
    height, width = grid
    latitude, longitude = grid_coordinates(height, width)
    rows, columns = tile_bounds(manager, height, width)
    time = np.datetime64("2020-01-01T00", "ns") + np.arange(times) * np.timedelta64(6, "h")
    if manager.dp_rank == 0:
        rng = np.random.default_rng(seed)
        variables = {}
        for name, (long_name, units, means, amplitude) in SYNTHETIC_VARIABLES.items():
            attrs = {"long_name": long_name, "units": units}
            if isinstance(means, tuple):
                levels = [_field(rng, latitude, longitude, times, mean, amplitude, rows, columns) for mean in means]
                variables[name] = (("time", "level", "latitude", "longitude"), np.stack(levels, axis=1), attrs)
            else:
                data = _field(rng, latitude, longitude, times, means, amplitude, rows, columns)
                variables[name] = (("time", "latitude", "longitude"), data, attrs)
        tile = xr.Dataset(variables, coords={"time": time, "level": np.array(LEVELS, dtype=np.int64),
                                             "latitude": latitude[rows], "longitude": longitude[columns]},
                          attrs={"title": "mpidomain synthetic ERA5-like fields"})
        write_tile(tile, path, manager, chunks={"time": 1, "level": len(LEVELS)})
    barrier(library_comm(manager, "world"), "the synthetic store")
    return list(SYNTHETIC_VARIABLES)

"""Read each rank's tile (and its halos) straight from Zarr and netCDF with xarray, write tiles back to Zarr; a torch
Dataset of tiles.

Needs the ``data`` extra (xarray, zarr, netCDF4); the rest of mpidomain does not.
"""

from .counting import CountingStore
from .select import select_tile
from .window import TileWindow, tile_window
from .write import write_tile

__all__ = ["select_tile", "write_tile", "TileDataset", "TileWindow", "tile_window", "CountingStore"]


def __getattr__(name):
    if name == "TileDataset":  # needs torch, which the data extra does not install
        from .dataset import TileDataset

        return TileDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

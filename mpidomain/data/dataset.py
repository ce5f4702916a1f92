"""A torch Dataset of each rank's tiles: every sample read straight into its tile and halos, channels stacked."""

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from .._agreement import agree
from .._current import require_manager
from ..manager import library_comm
from .select import _grid, select_tile
from .window import tile_window

__all__ = ["TileDataset"]


class TileDataset(Dataset):
    """Each time step of ``data`` as this rank's ``(C, H_tile, W_tile)`` float tile, halos included.

    Collective to build (it calls :func:`~mpidomain.data.select_tile` with
    ``halo``, ``boundary`` and ``periodic``): every rank of the domain group
    passes the same data and arguments. Item ``i`` reads time step ``i`` of
    this rank's tile and halos only (local, no communication), as a tensor of
    ``dtype`` whose channels are, in order: each variable of ``variables``
    that has ``level_dim``, at each of ``levels`` (variable-major: ``t@500,
    t@850, u@500, ...``; all levels if None), then each variable without it
    (surface fields), in ``variables`` order; :attr:`channels` names them.
    Variables without ``time_dim`` (static fields) give the same channels at
    every step. With ``mean`` and ``std`` (Datasets or mappings of the same
    variables: scalars, or along ``level_dim``), each channel is
    ``(x - mean) / std``, and the halos of zeros stay zeros: an item equals
    ``halo_exchange`` of the normalised tile.

    Every rank of a domain group must read the same sample, the data-parallel
    ranks different ones: :meth:`sampler` is a ``DistributedSampler`` over the
    data-parallel axis (``manager.data_parallel_coords()``; the same as one
    over the bridged ``manager.data_parallel_group``).

    A ``torch.utils.data.DataLoader`` may read it with worker processes
    (``num_workers``, ``persistent_workers``, ``prefetch_factor``; ``fork`` or
    ``spawn``): an item is pure I/O, so no worker makes an MPI call (a
    ``spawn`` worker's pickled copy holds no manager; a ``fork`` worker's copy
    keeps it and never calls it); build the sampler in the main process. The workers give the same samples in the same order as
    ``num_workers=0``.
    """

    def __init__(self, data, variables, levels=None, manager=None, *, halo=0, boundary=None, periodic=False,
                 time_dim="time", level_dim="level", lat="latitude", lon="longitude", mean=None, std=None,
                 dtype=torch.float32):
        self.manager = require_manager(manager, "TileDataset", alone_ok=True)
        variables = [variables] if isinstance(variables, str) else list(variables)
        error = None
        try:
            self._channels(data, variables, levels, level_dim)
            if (mean is None) != (std is None):
                raise ValueError("TileDataset: pass mean and std together (or neither)")
        except (TypeError, ValueError) as exc:
            error = exc
        if self.manager is not None:
            agree(library_comm(self.manager), "TileDataset", (variables, repr(levels), time_dim, level_dim), error=error)
        elif error is not None:
            raise error
        self._tile = select_tile(data, self.manager, halo=halo, boundary=boundary, periodic=periodic, lat=lat, lon=lon)
        self._time, self._level_dim, self.dtype = time_dim, level_dim, dtype
        self._length = data.sizes[time_dim] if time_dim in data.dims else 1
        self._scale = None if mean is None else tuple(self._per_channel(s) for s in (mean, std))
        window = tile_window((data.sizes[lat], data.sizes[lon]), *_grid(self.manager), halo, periodic, boundary)
        self._zero_rows = np.flatnonzero(np.asarray(window.rows) < 0)
        self._zero_columns = np.flatnonzero(np.asarray(window.columns) < 0)

    def _channels(self, data, variables, levels, level_dim):
        """Settle the channels: the upper-air variables, the level positions, the surface variables."""
        if not hasattr(data, "data_vars"):
            raise TypeError(f"TileDataset takes an xarray.Dataset, got {type(data).__name__}")
        missing = [v for v in variables if v not in data.data_vars]
        if missing:
            raise ValueError(f"TileDataset: variables {missing} are not in the data, whose variables are "
                             f"{list(data.data_vars)}; pass some of those")
        self._upper = [v for v in variables if level_dim in data[v].dims]
        self._surface = [v for v in variables if level_dim not in data[v].dims]
        available = data[level_dim].values.tolist() if self._upper else []
        levels = available if levels is None else list(levels)
        absent = [lv for lv in levels if lv not in available]
        if self._upper and absent:
            raise ValueError(f"TileDataset: levels {absent} are not in {level_dim!r}, whose values are {available}; "
                             "pass levels from those")
        self._positions = [available.index(lv) for lv in levels] if self._upper else []
        self.channels = tuple([f"{v}@{lv}" for v in self._upper for lv in levels] + self._surface)

    def _per_channel(self, statistics):
        """One value per channel from per-variable statistics (scalars, or along the level dim)."""
        values = []
        for v in self._upper:
            s = np.asarray(statistics[v])
            values += list(np.broadcast_to(s[self._positions] if s.ndim else s, (len(self._positions),)))
        values += [float(np.asarray(statistics[v])) for v in self._surface]
        return np.asarray(values, dtype=np.float64)[:, None, None]

    def __len__(self):
        return self._length

    def __getstate__(self):
        """The dataset without its manager (communicators cannot leave the process): what a worker gets."""
        state = dict(self.__dict__)
        state["manager"] = None
        state["_data_parallel"] = self._data_parallel_coords()
        return state

    def _data_parallel_coords(self):
        """(data-parallel rank, number of data-parallel groups): the manager's, or those it had when pickled."""
        if self.manager is not None:
            return self.manager.data_parallel_coords()
        return self.__dict__.get("_data_parallel", (0, 1))

    def _step(self, name, index):
        variable = self._tile[name]
        return variable.isel({self._time: index}) if self._time in variable.dims else variable

    def __getitem__(self, index):
        if not -self._length <= index < self._length:
            raise IndexError(f"TileDataset has {self._length} samples, got index {index}")
        index %= self._length
        blocks = [self._step(v, index).isel({self._level_dim: self._positions}).values for v in self._upper]
        blocks += [self._step(v, index).values[None] for v in self._surface]
        x = np.concatenate(blocks, axis=0)
        if self._scale is not None:
            x = (x - self._scale[0]) / self._scale[1]
            x[:, self._zero_rows, :] = 0
            x[:, :, self._zero_columns] = 0
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.dtype)

    def sampler(self, shuffle=True, seed=0, drop_last=False):
        """Return a ``DistributedSampler`` over the data-parallel axis: the same indices on every rank of a domain group."""
        rank, size = self._data_parallel_coords()
        return DistributedSampler(self, num_replicas=size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)


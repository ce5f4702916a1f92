"""CREDIT's gen2 samples read by tile: :class:`TileSource` (the plan) and :class:`CreditTileDataset`.

An item is what CREDIT 2026.2.0's ``MultiSourceDataset`` returns for ``(t, i)``, cut to this
rank's tile: ``{"input": {source: {key: (levels, T, rows, columns)}}, "target": {...},
"metadata": {source: {...}}}`` with CREDIT's keys (``source/kind/3d|2d/name``). At ``i == 0``
the input holds the dynamic forcing, the statics and the prognostics at ``t`` (a ``history_len``
window ending at ``t``); at ``i > 0`` only the dynamic forcing at ``t``; the target holds the
prognostics then the diagnostics at ``t + timestep``. Each variable is read from its file as
``.sel(time=t)`` (exact), its rows and columns of this tile only, and for 3-D variables
``.sel(level=levels, method="nearest")``, as float32.

Building the plan (:func:`plan_source`) is collective and checks the data first (world rank 0
opens each file's metadata, every rank gets the verdict): a year missing in the date range, a
time absent from its file, a variable absent, a level not found, grids that differ between files
raise one :class:`~mpidomain.command.UsageError` on every rank, naming the file, the variable and
the time. Reading an item is local and never calls MPI (DataLoader workers run it).
"""

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from .._errors import raised_alike
from ..command import UsageError
from .files import FileIndex, index_files
from .output import tile_extent

__all__ = ["TileSource", "CreditTileDataset", "plan_source", "source_clock"]

_OPEN_FILES = 8


@dataclass(frozen=True)
class TileSource:
    """Everything an item read needs, picklable (DataLoader workers get a copy): no manager, no MPI."""

    data: object                        # config.DataSettings
    files: Tuple[Tuple[str, FileIndex], ...]   # (field kind, its files)
    levels: Optional[Tuple[float, ...]]  # the level values to match by nearest value
    shape: Tuple[int, int]               # the global (latitude, longitude) extents
    rows: Tuple[int, int]                # this tile's [start, stop) rows
    columns: Tuple[int, int]             # this tile's [start, stop) columns
    lat_dim: str
    lon_dim: str
    latitude: Tuple[float, ...]          # the global latitudes (degrees, file order)
    longitude: Tuple[float, ...]

    def index(self, kind):
        """The :class:`~mpidomain.credit.files.FileIndex` of field ``kind``."""
        return dict(self.files)[kind]


def source_clock(data):
    """The init times of a ``data`` block, as CREDIT builds them: from ``start + (history_len - 1) * timestep`` to
    ``end - forecast_len * timestep`` every ``timestep`` (a ``pd.DatetimeIndex``); pure."""
    step = pd.Timedelta(data.timestep)
    start = pd.Timestamp(data.start) + (data.history_len - 1) * step
    end = pd.Timestamp(data.end) - data.forecast_len * step
    return pd.date_range(start, end, freq=step)


def _times_needed(data, kind):
    """Every time field ``kind`` is read at by a ``data`` block's samples (static: None)."""
    clock = source_clock(data)
    if kind == "static" or not len(clock):
        return None if kind == "static" else pd.DatetimeIndex([])
    step = pd.Timedelta(data.timestep)
    first, last = {"prognostic": (-(data.history_len - 1), data.forecast_len),
                   "diagnostic": (1, data.forecast_len),
                   "dynamic_forcing": (-(data.history_len - 1), data.forecast_len - 1)}[kind]
    return pd.date_range(clock[0] + first * step, clock[-1] + last * step, freq=step)


def _level_positions(values, wanted, where):
    """Nearest positions of ``wanted`` in ``values``; ValueError for a level outside the file's levels."""
    values = np.asarray(values, dtype=np.float64)
    spacing = np.min(np.abs(np.diff(np.sort(values)))) if len(values) > 1 else 0.0
    positions = []
    for level in wanted:
        at = int(np.abs(values - level).argmin())
        if abs(values[at] - level) > max(spacing / 2, 1e-9 * max(1.0, abs(level))) and \
                (level < values.min() or level > values.max() or len(values) == 1):
            raise ValueError(f"{where}: level {level:g} is not found (the file's levels run from {values.min():g} to "
                             f"{values.max():g}); choose levels the files hold")
        positions.append(at)
    if len(set(positions)) != len(positions):
        raise ValueError(f"{where}: levels {list(wanted)} match the same file level twice by nearest value (file "
                         f"levels {values.tolist()}); choose distinct levels")
    return positions


def _open(path, engine):
    import xarray as xr

    return xr.open_dataset(path, engine=engine, cache=False)


def _names_like(name, names, whole=40):
    """What a file offers instead of ``name``: its closest names, then every name (the first ``whole``)."""
    import difflib

    names = [str(n) for n in names]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    close += [n for n in names if n.lower() == name.lower() and n not in close]
    text = f"closest: {', '.join(close)}; " if close else ""
    if len(names) <= whole:
        return text + f"the file has {len(names)} variable(s): {', '.join(names)}"
    return text + f"the file has {len(names)} variables: {', '.join(names[:whole])} and {len(names) - whole} more"


def _check_file(data, kind, path, variables, times, reference, engine):
    """Check one file; return its grid ((lat dim, lon dim), shape, latitudes, longitudes)."""
    with _open(path, engine) as ds:
        tdim = data.time_coord
        for name in variables:
            if name not in ds.data_vars:
                raise ValueError(f"{path}: variable {name} ({kind}) is absent; {_names_like(name, ds.data_vars)}; "
                                 f"fix data.source.*.variables.{kind} or the file")
        if times is not None:
            if tdim not in ds.coords:
                raise ValueError(f"{path}: no time coordinate {tdim!r} for the {kind} variables; set time_coord")
            have = pd.DatetimeIndex(ds[tdim].values)
            missing = times[~times.isin(have)]
            if len(missing):
                raise ValueError(f"{path}: time {missing[0]} ({kind}: {', '.join(variables)}) is absent from the file"
                                 f"{' (and %d more)' % (len(missing) - 1) if len(missing) > 1 else ''}; the samples "
                                 "read it")
        grid = None
        for name in variables:
            dims = [d for d in ds[name].dims if d != tdim]
            if data.level_coord in dims:
                if dims[0] != data.level_coord:
                    raise ValueError(f"{path}: variable {name} has dims {ds[name].dims}; the level dim "
                                     f"{data.level_coord!r} must come first after time")
                if data.levels is not None:
                    if data.level_coord not in ds.coords:
                        raise ValueError(f"{path}: variable {name} has no {data.level_coord!r} coordinate to match "
                                         "levels by value")
                    _level_positions(ds[data.level_coord].values, data.levels, f"{path}: variable {name}")
                dims = dims[1:]
            if len(dims) != 2:
                raise ValueError(f"{path}: variable {name} has dims {ds[name].dims}; expected (time,) [level,] "
                                 "latitude, longitude")
            lat = np.asarray(ds[dims[0]].values) if dims[0] in ds.coords else np.arange(ds.sizes[dims[0]])
            lon = np.asarray(ds[dims[1]].values) if dims[1] in ds.coords else np.arange(ds.sizes[dims[1]])
            here = (tuple(dims), (len(lat), len(lon)), lat, lon)
            if grid is None:
                grid = here
            elif here[1] != grid[1] or not (np.array_equal(here[2], grid[2]) and np.array_equal(here[3], grid[3])):
                raise ValueError(f"{path}: variable {name}'s grid {here[1]} differs from {variables[0]}'s {grid[1]}")
        if grid is not None and reference is not None:
            _, ref_path, (ref_dims, ref_shape, ref_lat, ref_lon) = reference
            if grid[1] != ref_shape or not (np.allclose(grid[2], ref_lat) and np.allclose(grid[3], ref_lon)):
                raise ValueError(f"{path}: its grid ({grid[1][0]} x {grid[1][1]}, latitude {grid[2][0]:g} .. "
                                 f"{grid[2][-1]:g}) differs from {ref_path}'s ({ref_shape[0]} x {ref_shape[1]}, "
                                 f"latitude {ref_lat[0]:g} .. {ref_lat[-1]:g}); put every field on one grid")
        return grid


def _check_data(blocks, engine, needed=None):
    """Check every file the ``blocks`` (DataSettings) read; return (file indices per block, grid).

    ``needed``: per block, ``{field kind: the times read}`` (a DatetimeIndex; None for statics) instead of
    every time the block's training clock reads."""
    reference, indices = None, []
    for number, (where, data) in enumerate(zip(("data", "validation_data"), blocks)):
        reads = None if needed is None else needed[number]
        if reads is None and not len(source_clock(data)):
            raise ValueError(f"{where}: no init time between start_datetime {data.start} (plus history_len - 1 = "
                             f"{data.history_len - 1} steps) and end_datetime {data.end} (minus forecast_len = "
                             f"{data.forecast_len} steps of {data.timestep}); widen the date range")
        per_kind = []
        for field in data.fields:
            try:
                files = index_files(field.path, field.time_format)
            except ValueError as error:
                raise ValueError(f"data.source.{data.source}.variables.{field.kind}.path: {error}") from None
            times = _times_needed(data, field.kind) if reads is None else \
                (None if field.kind == "static" else pd.DatetimeIndex(reads.get(field.kind, [])))
            by_file = OrderedDict()
            if times is None:
                by_file[files.paths()[0]] = None
            else:
                for time in times:
                    try:
                        path = files.find(time)
                    except ValueError as error:
                        raise ValueError(f"{field.kind} ({', '.join(field.vars_3d + field.vars_2d)}): {error}") \
                            from None
                    by_file.setdefault(path, []).append(time)
            for path, wanted in by_file.items():
                grid = _check_file(data, field.kind, path, list(field.vars_3d + field.vars_2d),
                                   None if wanted is None else pd.DatetimeIndex(wanted), reference, engine)
                if reference is None and grid is not None:
                    reference = (field.kind, path, grid)
            per_kind.append((field.kind, files))
        indices.append(tuple(per_kind))
    return tuple(indices), reference[2]


def plan_source(comm, data_blocks, manager, model_shape=None, needed=None):
    """Check the data of ``data_blocks`` (DataSettings: training, validation) and plan this rank's reads.

    Collective over ``comm`` (the job's ranks): world rank 0 indexes the files and opens each one's metadata,
    every rank gets the verdict. Returns one :class:`TileSource` per block, for this rank's tile of
    ``manager``'s layout. A problem raises :class:`UsageError` alike on every rank, naming the file, the
    variable and the time; so does a grid other than ``model_shape`` (the model's image height and width).
    ``needed`` (a rollout's reads): per block, ``{field kind: times}`` checked instead of the training clock's.
    """
    outcome = None
    if comm.Get_rank() == 0:
        try:
            engine = data_blocks[0].engine
            indices, grid = _check_data(data_blocks, engine, needed)
            dims, shape = grid[0], grid[1]
            if model_shape is not None and tuple(model_shape) != tuple(shape):
                raise ValueError(f"the data's grid is {shape[0]} x {shape[1]} but model.image_height x image_width "
                                 f"is {model_shape[0]} x {model_shape[1]}; make them agree")
            outcome = ("ok", indices, dims, shape, tuple(map(float, grid[2])), tuple(map(float, grid[3])))
        except (ValueError, OSError, KeyError) as error:
            text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            outcome = ("error", text)
    outcome = comm.bcast(outcome, root=0)
    if outcome[0] == "error":
        raise raised_alike(UsageError(outcome[1]))
    _, indices, dims, shape, latitude, longitude = outcome
    rows, columns = ((r.start, r.stop) for r in tile_extent(manager, shape))
    return tuple(TileSource(data, files, data.levels, tuple(shape), rows, columns, dims[0], dims[1], latitude,
                            longitude) for data, files in zip(data_blocks, indices))


class CreditTileDataset(Dataset):
    """CREDIT's gen2 samples, this rank's tile of each: index with ``(time, step)`` as CREDIT's sampler does.

    Local (no MPI): safe in DataLoader workers. ``datetimes`` is the init-time clock (CREDIT's); ``len`` its
    length. ``return_target=False`` for inference (no target, no target time). Each item's metadata also holds
    ``bytes``: the bytes of values this rank read for it.
    """

    def __init__(self, plan, return_target=True):
        self.plan = plan
        self.return_target = return_target
        self.datetimes = source_clock(plan.data)
        self.dt = pd.Timedelta(plan.data.timestep)
        self._open = OrderedDict()

    def __len__(self):
        return len(self.datetimes)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_open"] = OrderedDict()  # open files stay with the process that opened them
        return state

    def _dataset(self, path):
        ds = self._open.pop(path, None)
        if ds is None:
            ds = _open(path, self.plan.data.engine)
            while len(self._open) >= _OPEN_FILES:
                self._open.popitem(last=False)[1].close()
        self._open[path] = ds
        return ds

    def read(self, kind, times):
        """Return ``({key: (levels, len(times), rows, columns) float32 tensor}, bytes read)`` of field ``kind``.

        ``times``: a list of timestamps (ignored for statics, whose one field is repeated). Local.
        """
        plan, data = self.plan, self.plan.data
        field = data.field(kind)
        if field is None:
            return {}, 0
        index = plan.index(kind)
        window = {plan.lat_dim: slice(*plan.rows), plan.lon_dim: slice(*plan.columns)}
        out, nbytes = {}, 0
        for names, dim in ((field.vars_3d, "3d"), (field.vars_2d, "2d")):
            for name in names:
                steps = []
                for time in ([times[-1]] if kind == "static" else times):
                    path = index.find(time)
                    variable = self._dataset(path)[name]
                    if data.time_coord in variable.dims:
                        variable = variable.isel({data.time_coord: 0}) if kind == "static" else \
                            variable.sel({data.time_coord: np.datetime64(pd.Timestamp(time), "ns")})
                    variable = variable.isel(window)
                    if dim == "3d" and plan.levels is not None:
                        variable = variable.sel({data.level_coord: list(plan.levels)}, method="nearest")
                    values = np.asarray(variable.values, dtype=np.float32)
                    nbytes += values.nbytes
                    steps.append(values if dim == "3d" else values[None])
                tensor = torch.from_numpy(np.stack(steps, axis=1))
                if kind == "static" and len(times) > 1:
                    tensor = tensor.repeat(1, len(times), 1, 1)
                out[f"{data.source}/{kind}/{dim}/{name}"] = tensor
        return out, nbytes

    def __getitem__(self, item):
        time, step = item
        time = pd.Timestamp(time)
        data = self.plan.data
        history = [time - k * self.dt for k in range(data.history_len - 1, -1, -1)]
        inputs, total = {}, 0
        kinds = ("dynamic_forcing", "static", "prognostic") if step == 0 else ("dynamic_forcing",)
        for kind in kinds:
            window = history if (step == 0 or kind != "dynamic_forcing") else [time]
            read, nbytes = self.read(kind, window)
            inputs.update(read)
            total += nbytes
        metadata = {"input_datetime": int(time.value)}
        sample = {"input": {data.source: inputs}}
        if self.return_target:
            target = {}
            for kind in ("prognostic", "diagnostic"):
                read, nbytes = self.read(kind, [time + self.dt])
                target.update(read)
                total += nbytes
            sample["target"] = {data.source: target}
            metadata["target_datetime"] = int((time + self.dt).value)
        metadata["bytes"] = total
        sample["metadata"] = {data.source: metadata}
        return sample

    def close(self):
        """Close the files this process opened."""
        while self._open:
            self._open.popitem()[1].close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


"""CREDIT's forecast files, written from tiles: :class:`ForecastWriter`.

The files are those CREDIT 2026.2.0's ``credit rollout`` writes
(``credit/output_gen2.py``): ``save_forecast/<init %Y%m%d_%H%MZ>/<valid
%Y-%m-%d_T%H%MZ>.nc`` (or ``.zarr``; one per day, month, year or forecast with
``group_by``), the predicted variables in physical units in the target layout's
order, named by the last part of their key, dims ``(time, level, latitude,
longitude)`` and ``(time, latitude, longitude)``, ``time`` as int64 in the
metadata's units, ``Conventions = "CF-1.11"``, netCDF compressed as
``output.encoding`` says (netCDF's own chunks), Zarr v3 one zstd chunk per
variable and step. Batch member 0 only. Where CREDIT's files have rough edges
this writes what it means: attributes for the ERA5 variables' long names too
(the metadata names them as gen1 did, :data:`GEN1_NAMES`), and the metadata's
``_FillValue`` in netCDF as in Zarr.

No rank holds more than its tile and one chunk of one variable:

- netCDF: one rank of the domain group writes each file (the files go round
  the group's ranks). For each chunk of each variable it receives the chunk's
  rows and columns from the ranks holding them (tagged messages on the
  library's domain communicator, straight into the chunk's buffer) and writes
  it as one region, HDF5's chunk cache off: a whole chunk is compressed and
  written once, never read back.
- Zarr: each rank writes its tile with :func:`mpidomain.data.write_tile`, which
  gathers each chunk on the rank holding its first row and column.

A file is written under a temporary name (``<name>.partial``) and renamed
when whole, so a killed run leaves no file under its final name that is not
whole, and a repeated run replaces the files. Collective over the domain group;
a mistake raises the same error on every rank before anything is written.
"""

import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import pandas as pd
import xarray as xr
import yaml
from xarray.coding.times import encode_cf_datetime

from .._agreement import agree
from .._current import require_manager
from .._datatypes import subarray
from .._errors import digest
from .._waits import wait_all
from ..command import UsageError, probe_writable
from ..layout.tiles import balanced_split
from ..manager import library_comm

__all__ = ["OutputVariable", "OutputFile", "ForecastWriter", "forecast_files", "load_metadata", "tile_extent", "tile_values",
           "GEN1_NAMES", "PARTIAL"]

#: The ERA5 names gen2 configs use, and the names CREDIT's ``metadata/era5.yaml`` gives their attributes under.
GEN1_NAMES = {"temperature": "T", "specific_humidity": "Q", "u_component_of_wind": "U",
              "v_component_of_wind": "V", "geopotential": "Z", "surface_pressure": "SP", "2m_temperature": "t2m",
              "pressure": "P"}
#: The suffix of a file being written.
PARTIAL = ".partial"
_TAG = 23761  # ForecastWriter's messages on the library's domain communicator
_DIMS_3D = ("time", "level", "latitude", "longitude")
_DIMS_2D = ("time", "latitude", "longitude")


@dataclass(frozen=True)
class OutputVariable:
    """One predicted variable, in the target layout's order: its ``key`` and, for a 3-D one, its ``levels``.

    ``key`` is CREDIT's var_key, e.g. ``"ERA5/prognostic/3d/temperature"``;
    ``levels`` the level coordinate's values (the source's config ``levels``),
    None for a 2-D variable. A 3-D variable takes ``len(levels)`` channels of
    the prediction, a 2-D one one channel.
    """

    key: str
    levels: Optional[Tuple[Any, ...]] = None

    @property
    def name(self):
        """The variable's name in the files: the last part of its key."""
        return self.key.split("/")[-1]

    @property
    def channels(self):
        """How many channels of the prediction the variable takes."""
        return 1 if self.levels is None else len(self.levels)


@dataclass(frozen=True)
class OutputFile:
    """One forecast file: its final ``path`` and the model ``steps`` it holds, with their ``valid_times``."""

    path: str
    steps: Tuple[int, ...]
    valid_times: Tuple[pd.Timestamp, ...]


def _period(group_by, valid):
    """The period ``valid`` falls in (files hold one period each)."""
    return {"day": lambda t: t.date(), "month": lambda t: (t.year, t.month), "year": lambda t: t.year,
            "full": lambda t: 0}.get(group_by, lambda t: t)(valid)


def _file_name(group_by, first, extension):
    """CREDIT's name of the file whose first step is valid at ``first``."""
    stems = {"year": f"{first.year:04d}", "month": f"{first.year:04d}-{first.month:02d}",
             "day": f"{first.year:04d}-{first.month:02d}-{first.day:02d}", "full": "full"}
    return stems.get(group_by, first.strftime("%Y-%m-%d_T%H%MZ")) + extension


def forecast_files(output, save_dir, init_time, steps, step_hours):
    """Return the files of the forecast from ``init_time``, in order: a tuple of :class:`OutputFile`.

    ``output`` is :class:`~mpidomain.credit.inference_settings.OutputSettings`;
    the forecast has ``steps`` model steps of ``step_hours`` each. As CREDIT:
    step ``k`` is written if its lead time ``k * step_hours`` is a multiple of
    ``output.interval_hours``; consecutive written steps of one period go to
    one file, named by its first step's valid time. (CREDIT loses the last
    file of a grouped forecast whose last step is not written; this keeps it.)
    Local, pure.
    """
    init = pd.Timestamp(init_time)
    folder = os.path.join(os.fspath(save_dir), init.strftime("%Y%m%d_%H%MZ"))
    groups = []
    for step in range(1, steps + 1):
        if output.interval_hours is not None and (step * step_hours) % output.interval_hours:
            continue
        valid = init + pd.Timedelta(hours=step * step_hours)
        if groups and _period(output.group_by, valid) == _period(output.group_by, groups[-1][0][1]):
            groups[-1].append((step, valid))
        else:
            groups.append([(step, valid)])
    return tuple(OutputFile(os.path.join(folder, _file_name(output.group_by, group[0][1], output.extension)),
                            tuple(s for s, _ in group), tuple(v for _, v in group)) for group in groups)


def load_metadata(path):
    """Return the CF attributes file ``path`` (YAML: ``{variable: {attribute: value}}``) as a dict; None: ``{}``.

    A bare file name is one of CREDIT's own (``credit/metadata/``, found
    without importing CREDIT), as CREDIT resolves it. Local: raises
    FileNotFoundError (CREDIT only warns) or ValueError for a file that is not
    such a mapping.
    """
    if not path:
        return {}
    resolved = os.path.expandvars(path)
    if not os.path.dirname(resolved):
        import importlib.util

        spec = importlib.util.find_spec("credit")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"inference.output.metadata: {path!r} names one of CREDIT's metadata files, but "
                                    "CREDIT (miles-credit) is not installed; give the file's path")
        resolved = os.path.join(list(spec.submodule_search_locations)[0], "metadata", resolved)
    if not os.path.isfile(resolved):
        raise FileNotFoundError(f"inference.output.metadata: {path!r}: no such file ({resolved}); give a path or "
                                "one of CREDIT's files, e.g. era5.yaml")
    with open(resolved) as stream:
        loaded = yaml.safe_load(stream)
    if not isinstance(loaded, dict) or not all(isinstance(v, dict) for v in loaded.values()):
        raise ValueError(f"inference.output.metadata: {resolved} is not a mapping of variables to their attributes")
    return loaded


def tile_extent(manager, shape):
    """Return this rank's ``(rows, columns)`` of a ``shape`` (latitude, longitude) field: two ranges. Local.

    Latitude slabs or tiles cut as :func:`mpidomain.balanced_split` cuts rows; the whole field without a manager.
    """
    grid, coords = _grid(manager)
    return tuple(_block(n, parts, c) for n, parts, c in zip(shape, grid, coords))


def _grid(manager):
    if manager is None:
        return (1, 1), (0, 0)
    return (tuple(manager.domain_shape) + (1,))[:2], (tuple(manager.domain_coords) + (0,))[:2]


def _block(extent, parts, coord):
    counts, offsets = balanced_split(extent, parts)
    return range(offsets[coord], offsets[coord] + counts[coord])


@dataclass(frozen=True)
class _DataVariable:
    """One data variable of the files: where its channels are in the prediction, its attributes and settings."""

    name: str
    key: str
    first: int  # its first channel in the prediction
    picks: Optional[Tuple[int, ...]]  # its levels written (indices among its own), None: 2-D
    attrs: Tuple[Tuple[str, Any], ...]
    fill: Any  # the metadata's or the encoding's _FillValue, None: the default (NaN)
    netcdf: Tuple[Tuple[str, Any], ...]

    @property
    def dims(self):
        return _DIMS_2D if self.picks is None else _DIMS_3D


@dataclass(frozen=True)
class _Plan:
    """What every file of a :class:`ForecastWriter` holds, alike on every rank."""

    variables: Tuple[_DataVariable, ...]
    levels: Any  # the level coordinate (NumPy), None without 3-D variables
    latitude: Any
    longitude: Any
    channels: int
    time_units: str
    calendar: str


def _attributes(name, metadata):
    """The metadata's attributes of ``name`` (by its own name, else its gen1 name): (attrs without _FillValue, fill)."""
    entry = metadata.get(name)
    if entry is None and GEN1_NAMES.get(name) in metadata:
        entry = metadata[GEN1_NAMES[name]]
    entry = dict(entry or {})
    fill = entry.pop("_FillValue", None)
    return tuple(entry.items()), fill


def _plan(output, variables, latitude, longitude, calendar, metadata):
    """Check the writer's arguments against each other; return the :class:`_Plan` (UsageError, ValueError)."""
    variables = tuple(variables)
    if not variables or not all(isinstance(v, OutputVariable) for v in variables):
        raise TypeError("ForecastWriter: variables must be a non-empty sequence of OutputVariable (the target "
                        "layout: var_key and levels of each predicted variable, in order)")
    keys = [v.key for v in variables]
    if len(set(keys)) != len(keys):
        raise ValueError(f"ForecastWriter: variables repeat a key: {keys}")
    for v in variables:
        three_d = len(v.key.split("/")) > 2 and v.key.split("/")[2] == "3d"
        if three_d != (v.levels is not None) or (v.levels is not None and not len(v.levels)):
            raise ValueError(f"ForecastWriter: variable {v.key!r} is {'3-D' if three_d else '2-D'} (its key's third "
                             f"part), so its levels must be {'a non-empty tuple' if three_d else 'None'}, got "
                             f"{v.levels!r}")
    latitude, longitude = np.asarray(latitude), np.asarray(longitude)
    if latitude.ndim != 1 or longitude.ndim != 1 or not latitude.size or not longitude.size:
        raise ValueError(f"ForecastWriter: latitude and longitude must be the grid's 1-D coordinates, got shapes "
                         f"{latitude.shape} and {longitude.shape}")
    wanted = dict(output.variables) if output.variables is not None else None
    if wanted is not None:
        unknown = [k for k in wanted if k not in keys]
        if unknown:
            raise UsageError(f"inference.output.variables: {unknown[0]!r} is not a variable the model predicts "
                             f"(it predicts {', '.join(keys)})")
    chosen, first, level_sets = [], 0, {}
    for v in variables:
        if wanted is None or v.key in wanted:
            picks = None
            if v.levels is not None:
                requested = wanted.get(v.key) if wanted is not None else None
                if requested is None:
                    picks = tuple(range(len(v.levels)))
                else:
                    missing = [level for level in requested if level not in v.levels]
                    if missing:
                        raise UsageError(f"inference.output.variables: {v.key!r} has no level {missing[0]!r} (its "
                                         f"levels are {list(v.levels)})")
                    picks = tuple(i for i, level in enumerate(v.levels) if level in requested)
                level_sets[v.key] = tuple(v.levels[i] for i in picks)
            attrs, fill = _attributes(v.name, metadata)
            chosen.append((v, first, picks, attrs, fill))
        first += v.channels
    names = [v.name for v, *_ in chosen]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"inference.output.variables: two variables written would have the name {twice[0]!r} (the "
                         "last part of their keys); write one of them only")
    if len(set(level_sets.values())) > 1:
        raise UsageError(f"inference.output.variables: the 3-D variables written have different levels "
                         f"({', '.join(f'{k}: {list(s)}' for k, s in level_sets.items())}), but a file has one level "
                         "coordinate (CREDIT would fill the missing levels with NaN); request the same levels for each")
    for key, own in output.variable_encoding:
        if not any(key in (v.name, v.key) or key.split("/")[-1] == v.name for v, *_ in chosen):
            raise UsageError(f"inference.output.encoding.{key}: names no variable written (they are "
                             f"{', '.join(names)})")
    data = []
    for v, offset, picks, attrs, fill in chosen:
        settings = output.netcdf_settings(v.name, v.key)
        ndim = 3 if picks is None else 4
        if "chunksizes" in settings and len(settings["chunksizes"]) != ndim:
            raise UsageError(f"inference.output.encoding: chunksizes {list(settings['chunksizes'])} for {v.name!r} "
                             f"must have {ndim} sizes, one per dim {_DIMS_2D if picks is None else _DIMS_3D}")
        if "_FillValue" in settings:
            fill = settings.pop("_FillValue")
        data.append(_DataVariable(v.name, v.key, offset, picks, attrs, fill, tuple(settings.items())))
    levels = next(iter(level_sets.values()), None)
    time_meta = metadata.get("time") or {}
    calendar = calendar or time_meta.get("calendar", "proleptic_gregorian")
    units = time_meta.get("units", "seconds since 1970-01-01")
    try:
        _, units, calendar = encode_cf_datetime(np.array(["2000-01-01"], dtype="datetime64[ns]"), units, calendar,
                                                np.dtype("int64"))
    except (ValueError, TypeError, OverflowError) as exc:
        raise UsageError(f"inference.output.metadata: time units {units!r} with calendar {calendar!r} cannot encode "
                         f"the times ({exc})") from None
    return _Plan(tuple(data), None if levels is None else np.asarray(levels), latitude, longitude, first, units,
                 calendar)


def _netcdf_order(plan, steps_in_file):
    """The variables of a netCDF file in CREDIT's (xarray's) order: for one step, each data variable after the
    coordinates it brings first; for several (concatenated along time), the data variables, then the coordinates."""
    single, coordinates = [], []
    for variable in plan.variables:
        new = [d for d in variable.dims if d not in coordinates]
        coordinates += new
        single += new + [variable.name]
    return single if steps_in_file == 1 else [v.name for v in plan.variables] + coordinates


def tile_values(array, channels, call="ForecastWriter.write", what="prediction"):
    """``array`` (torch or NumPy; (C, h, w), (B, C, h, w) or (B, C, 1, h, w)) as this rank's (C, h, w) NumPy tile
    (batch member 0); a ValueError naming ``call`` and ``what`` for another shape. Local."""
    if hasattr(array, "detach") and hasattr(array, "cpu"):
        array = array.detach().cpu().numpy()
    values = np.asarray(array)
    if values.ndim == 5 and values.shape[2] == 1:
        values = values[0, :, 0]
    elif values.ndim == 4:
        values = values[0]
    if values.ndim != 3 or values.shape[0] != channels:
        raise ValueError(f"{call}: {what} must be this rank's tile of the target layout's {channels} channels, "
                         f"(C, h, w), (B, C, h, w) or (B, C, 1, h, w), got shape {tuple(np.shape(array))}")
    if values.dtype.kind != "f":
        raise TypeError(f"ForecastWriter.write: prediction must be floating point, got {values.dtype}")
    return values


def _remove(path):
    """Remove the file or folder ``path`` if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _sync(path):
    """Flush ``path`` (a file or folder) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _commit(partial, final):
    """Give the whole file or store ``partial`` its ``final`` name; a file there before is replaced."""
    if os.path.isdir(partial):
        if os.path.lexists(final):
            aside = final + ".replaced"
            _remove(aside)
            os.replace(final, aside)  # a kill now leaves no final name, never a mix of the two
            os.replace(partial, final)
            _remove(aside)
        else:
            os.replace(partial, final)
    else:
        _sync(partial)
        os.replace(partial, final)
    _sync(os.path.dirname(final) or ".")


@dataclass
class _Open:
    """The file being written: its :class:`OutputFile`, the next step's place in it, and (writer) its handle."""

    file: OutputFile
    index: int
    writer: int
    handle: Any = None
    blocks: Any = None  # netCDF: {variable name: its chunk shape}, alike on every rank


class ForecastWriter:
    """Write a forecast, step by step, from tiles, into CREDIT's files (see the module docstring).

    Construction is collective over the job (every rank of the manager's
    world, once): ``output`` is
    :class:`~mpidomain.credit.inference_settings.OutputSettings`,
    ``variables`` the target layout (:class:`OutputVariable` each, in order),
    ``latitude`` and ``longitude`` the whole grid's coordinates (the data
    file's), ``save_dir`` the ``save_forecast`` folder, ``steps`` and
    ``step_hours`` the forecast's model steps and their length, ``calendar``
    the data's. Bad settings (a variable or level requested that the model
    does not predict, an encoding for no variable written, a metadata file
    that cannot be read, a folder that cannot be written) raise the same
    error on every rank, before any file is written.
    """

    def __init__(self, output, variables, latitude, longitude, save_dir, *, steps, step_hours,
                 calendar="standard", manager=None):
        self._manager = manager = require_manager(manager, "ForecastWriter", alone_ok=True)
        self._output, self._save_dir = output, os.fspath(save_dir)
        self._steps, self._step_hours = int(steps), int(step_hours)
        self._grid, self._coords = _grid(manager)
        self._comm = None if manager is None else library_comm(manager, "domain")
        self._rank = 0 if self._comm is None else self._comm.Get_rank()
        self._size = 1 if self._comm is None else self._comm.Get_size()
        self._open, self._started, self._written, self._schedules = None, 0, [], {}
        error = description = None
        try:
            try:
                metadata = load_metadata(output.metadata)
            except OSError as exc:
                raise UsageError(str(exc)) from None
            self._plan = _plan(output, variables, latitude, longitude, calendar, metadata)
            shape = (len(self._plan.latitude), len(self._plan.longitude))
            if manager is not None and manager.shard_dims not in ((-2,), (-2, -1)):
                raise ValueError(f"ForecastWriter writes latitude slabs (shard_dim=-2) or latitude x longitude tiles "
                                 f"(shard_dim=(-2, -1)), but the manager shards dims {manager.shard_dims}")
            if any(n < parts for n, parts in zip(shape, self._grid)):
                raise ValueError(f"ForecastWriter: a {shape[0]} x {shape[1]} grid cannot be cut into "
                                 f"{self._grid[0]} x {self._grid[1]} tiles")
            self._rows, self._columns = tile_extent(manager, shape)
            self._tiles = [tuple(_block(n, parts, c) for n, parts, c in zip(shape, self._grid,
                                                                             divmod(r, self._grid[1])))
                           for r in range(self._size)]
            try:
                os.makedirs(self._save_dir, exist_ok=True)
                probe_writable(self._save_dir)
            except OSError as exc:
                raise UsageError(f"inference.save_forecast: {self._save_dir!r} cannot be written ({exc}); give a "
                                 "folder this job can write") from None
            description = digest((repr(output), repr(tuple(variables)), self._save_dir, self._steps, self._step_hours,
                                  calendar, self._plan.latitude.tobytes(), self._plan.longitude.tobytes()))
        except (ValueError, TypeError, KeyError) as exc:
            error = exc
        if manager is None:
            if error is not None:
                raise error
            return
        agree(library_comm(manager, "world"), "ForecastWriter", description, error=error,
              mismatch=lambda _: ValueError("ForecastWriter needs the same settings, variables, grid and folder on "
                                            "every rank of the job"))

    @property
    def written(self):
        """The files this rank's domain group has completed so far (their final paths), in order."""
        return tuple(self._written)

    def files(self, init_time):
        """Return the files of the forecast from ``init_time`` (:func:`forecast_files`). Local."""
        key = pd.Timestamp(init_time)
        if key not in self._schedules:
            self._schedules[key] = forecast_files(self._output, self._save_dir, key, self._steps, self._step_hours)
        return self._schedules[key]

    def write(self, prediction, init_time, step):
        """Write model step ``step`` (1 to ``steps``) of the forecast from ``init_time``: this rank's tile of it.

        Collective over the domain group: call on every rank of the group with
        its own tile of the prediction (a torch tensor or NumPy array, physical
        units, the target layout's channels: (C, h, w), (B, C, h, w) or (B, C,
        1, h, w); batch member 0 is written) and the same ``init_time`` and
        ``step``. Steps of one forecast come in order; a step that
        ``output_interval`` leaves out is skipped. Every rank returns the final
        path of the file the step completed, or None. A step that does not
        follow the one before in its file, a tile of the wrong shape, or a
        failed write raise the same error on every rank.
        """
        error = values = target = None
        try:
            values = tile_values(prediction, self._plan.channels)
            expected = (len(self._rows), len(self._columns))
            if values.shape[1:] != expected:
                raise ValueError(f"ForecastWriter.write: this rank's tile is {expected[0]} x {expected[1]} (rows x "
                                 f"columns of the {len(self._plan.latitude)} x {len(self._plan.longitude)} grid), "
                                 f"got {values.shape[1]} x {values.shape[2]}")
            target = self._target(pd.Timestamp(init_time), int(step))
        except (ValueError, TypeError) as exc:
            error = exc
        if self._comm is not None:
            description = None if error is not None else (str(pd.Timestamp(init_time)), int(step), str(values.dtype))
            agree(self._comm, "ForecastWriter.write", description, error=error,
                  mismatch=lambda d: ValueError(f"ForecastWriter.write needs the same init time, step and prediction "
                                                f"dtype on every rank of the domain group, got (init time, step, "
                                                f"dtype) {d}"))
        elif error is not None:
            raise error
        if target is None:
            return None
        file, index = target
        try:
            if index == 0:
                self._start(file, values.dtype)
            if self._output.format == "netcdf":
                self._write_netcdf(values, index)
            else:
                self._write_zarr(values, index)
            self._open.index = index + 1
            if index + 1 < len(file.steps):
                return None
            self._finish_file()
        except BaseException:
            self._abandon()  # the file stays under its temporary name; a new forecast can start
            raise
        return file.path

    def finish(self):
        """Check that every file started is whole; return the files completed (final paths), in order.

        Call on every rank of the domain group (each decides alike, locally). A
        forecast left unfinished (its last written step never came) raises the
        same ValueError on every rank; its file keeps its temporary name.
        """
        if self._open is not None:
            file, done = self._open.file, self._open.index
            self._abandon()
            raise ValueError(f"ForecastWriter.finish: {file.path} is not whole: it has {done} of its steps "
                             f"{list(file.steps)}; write steps {list(file.steps[done:])} first")
        return self.written

    # -- the steps of one file ------------------------------------------------

    def _target(self, init, step):
        """The file ``step`` of the forecast from ``init`` goes in and its place there, or None (not written)."""
        if not 1 <= step <= self._steps:
            raise ValueError(f"ForecastWriter.write: step must be 1 to {self._steps} (the forecast's steps), got "
                             f"{step}")
        for file in self.files(init):
            if step in file.steps:
                index = file.steps.index(step)
                current = self._open
                if current is not None and (current.file != file or current.index != index):
                    raise ValueError(f"ForecastWriter.write: step {step} of the forecast from {init} does not follow "
                                     f"{current.file.path}'s step {current.file.steps[current.index - 1]}: it still "
                                     f"needs steps {list(current.file.steps[current.index:])}")
                if current is None and index != 0:
                    raise ValueError(f"ForecastWriter.write: step {step} of the forecast from {init} goes in "
                                     f"{file.path} after steps {list(file.steps[:index])}, which were not written")
                return file, index
        return None

    def _start(self, file, dtype):
        """Begin ``file`` under its temporary name (removing what a killed run left there)."""
        writer = self._started % self._size if self._output.format == "netcdf" else 0
        self._started += 1
        self._open = opened = _Open(file, 0, writer)
        partial, error, blocks = file.path + PARTIAL, None, None
        if self._rank == writer:
            try:
                os.makedirs(os.path.dirname(partial), exist_ok=True)
                _remove(partial)
                if self._output.format == "netcdf":
                    opened.handle, blocks = _create_netcdf(partial, self._plan, file.valid_times, dtype)
            except Exception as exc:  # noqa: BLE001 - raised alike on every rank below
                error = exc
        if self._comm is not None and self._output.format == "netcdf":
            blocks = self._comm.bcast(blocks, root=writer)
        opened.blocks = blocks
        self._settle("ForecastWriter.write", error)

    def _abandon(self):
        """Forget the file being written, closing it (the writer) under its temporary name."""
        opened, self._open = self._open, None
        if opened is not None and opened.handle is not None:
            try:
                opened.handle.close()
            except Exception:  # noqa: BLE001 - already failing: the first error is the one to see
                pass

    def _finish_file(self):
        """Close the file being written and give it its final name."""
        opened, error = self._open, None
        self._open = None
        if self._rank == opened.writer:
            partial = opened.file.path + PARTIAL
            try:
                if opened.handle is not None:
                    opened.handle.close()
                else:
                    import zarr

                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # consolidated metadata is not in the Zarr v3 spec (yet)
                        zarr.consolidate_metadata(partial)
                _commit(partial, opened.file.path)
            except Exception as exc:  # noqa: BLE001 - raised alike on every rank below
                error = exc
        self._settle("ForecastWriter.write", error)
        self._written.append(opened.file.path)

    def _settle(self, call, error):
        """Raise ``error`` (a local failure, or None) alike on every rank of the domain group."""
        if self._comm is not None:
            agree(self._comm, call, None, error=error)
        elif error is not None:
            raise error

    # -- netCDF: one writer, a chunk at a time ----------------------------------

    def _write_netcdf(self, values, index):
        """Write ``values`` (this rank's tile) as step ``index`` of the open netCDF file, chunk by chunk."""
        opened, comm, me = self._open, self._comm, self._rank
        error = None
        rows0, columns0 = self._rows.start, self._columns.start
        for variable in self._plan.variables:
            local = _channels(values, variable)
            chunk = opened.blocks[variable.name]
            for levels, rows, columns in _chunk_blocks(local.shape[0], len(self._plan.latitude),
                                                       len(self._plan.longitude), chunk):
                pieces = [(rank, _overlap(rows, tile[0]), _overlap(columns, tile[1]))
                          for rank, tile in enumerate(self._tiles)]
                pieces = [(rank, r, c) for rank, r, c in pieces if len(r) and len(c)]
                if me == opened.writer:
                    block = np.empty((levels.stop - levels.start, len(rows), len(columns)), local.dtype)
                    requests, types = [], []
                    for rank, r, c in pieces:
                        into = (slice(None), slice(r.start - rows.start, r.stop - rows.start),
                                slice(c.start - columns.start, c.stop - columns.start))
                        if rank == me:
                            block[into] = local[levels, r.start - rows0:r.stop - rows0,
                                                c.start - columns0:c.stop - columns0]
                            continue
                        types.append(subarray(block.shape, block.itemsize, into))
                        requests.append(comm.Irecv([block, 1, types[-1]], source=rank, tag=_TAG))
                    if requests:
                        wait_all(requests, comm=comm, call="ForecastWriter.write")
                    for datatype in types:
                        datatype.Free()
                    if error is None:
                        try:
                            region = (index, levels) if variable.picks is not None else (index,)
                            target = opened.handle.variables[variable.name]
                            target[region + (slice(rows.start, rows.stop), slice(columns.start, columns.stop))] = (
                                block if variable.picks is not None else block[0])
                        except Exception as exc:  # noqa: BLE001 - the others still send: raised after
                            error = exc
                    del block
                else:
                    for rank, r, c in pieces:
                        if rank != me:
                            continue
                        rows_here = slice(r.start - rows0, r.stop - rows0)
                        columns_here = slice(c.start - columns0, c.stop - columns0)
                        datatype = subarray(local.shape, local.itemsize, (levels, rows_here, columns_here))
                        request = comm.Issend([local, 1, datatype], dest=opened.writer, tag=_TAG)
                        wait_all([request], comm=comm, call="ForecastWriter.write")
                        datatype.Free()
        self._settle("ForecastWriter.write", error)

    # -- Zarr: every rank its tile ----------------------------------------------

    def _write_zarr(self, values, index):
        """Append ``values`` (this rank's tile) as step ``index`` of the open Zarr store, with write_tile."""
        from ..data import write_tile

        opened, plan = self._open, self._plan
        units, calendar = plan.time_units, plan.calendar
        data_vars = {}
        for variable in plan.variables:
            local = _channels(values, variable)
            data = local[np.newaxis] if variable.picks is not None else local[:1]
            data_vars[variable.name] = xr.Variable(variable.dims, data, dict(variable.attrs))
            if variable.fill is not None:
                data_vars[variable.name].encoding["_FillValue"] = variable.fill
        time = xr.Variable(("time",), np.array([opened.file.valid_times[index]], dtype="datetime64[ns]"))
        time.encoding = {"units": units, "calendar": calendar, "dtype": np.dtype("int64")}
        coords = {"time": time, "latitude": plan.latitude[self._rows.start:self._rows.stop],
                  "longitude": plan.longitude[self._columns.start:self._columns.stop]}
        if plan.levels is not None:
            coords["level"] = plan.levels
        tile = xr.Dataset(data_vars, coords, attrs={"Conventions": "CF-1.11"})
        write_tile(tile, opened.file.path + PARTIAL, self._manager, append_dim="time",
                   chunks={"latitude": len(plan.latitude), "longitude": len(plan.longitude)})


def _channels(values, variable):
    """``variable``'s channels of the tile ``values``: (levels, h, w), C-contiguous (a view where it can be)."""
    if variable.picks is None:
        picked = values[variable.first:variable.first + 1]
    elif variable.picks == tuple(range(variable.picks[0], variable.picks[-1] + 1)):
        picked = values[variable.first + variable.picks[0]:variable.first + variable.picks[-1] + 1]
    else:
        picked = values[[variable.first + i for i in variable.picks]]
    return np.ascontiguousarray(picked)


def _overlap(a, b):
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _chunk_blocks(levels, height, width, chunk):
    """The blocks of one step of a variable, a chunk each: (level slice, rows, columns), in order."""
    level_chunk, row_chunk, column_chunk = chunk
    for l0 in range(0, levels, level_chunk):
        for r0 in range(0, height, row_chunk):
            for c0 in range(0, width, column_chunk):
                yield (slice(l0, min(l0 + level_chunk, levels)), range(r0, min(r0 + row_chunk, height)),
                       range(c0, min(c0 + column_chunk, width)))


def _create_netcdf(path, plan, valid_times, dtype):
    """Create the netCDF file ``path`` as CREDIT's writer (xarray's ``to_netcdf``) lays it out, coordinates written,
    data variables empty; return (the open file, ``{variable: (level, row, column) chunk}``)."""
    import netCDF4

    steps = len(valid_times)
    times, _, _ = encode_cf_datetime(np.array(valid_times, dtype="datetime64[ns]"), plan.time_units, plan.calendar,
                                     np.dtype("int64"))
    coordinates = {"time": (np.asarray(times, dtype=np.int64), {"units": plan.time_units, "calendar": plan.calendar}),
                   "latitude": (plan.latitude, {}), "longitude": (plan.longitude, {})}
    if plan.levels is not None:
        coordinates["level"] = (plan.levels, {})
    variables = {v.name: v for v in plan.variables}
    order = _netcdf_order(plan, steps)
    shapes = {"time": steps, "latitude": len(plan.latitude), "longitude": len(plan.longitude),
              "level": 0 if plan.levels is None else len(plan.levels)}
    handle = netCDF4.Dataset(path, "w", format="NETCDF4")
    chunks, created = {}, {}
    try:
        handle.setncatts({"Conventions": "CF-1.11"})
        for name in order:
            for dim in (variables[name].dims if name in variables else (name,)):
                if dim not in handle.dimensions:
                    handle.createDimension(dim, shapes[dim])
        for name in order:
            if name in variables:
                variable = variables[name]
                settings = dict(variable.netcdf)
                stored = np.dtype(settings.pop("dtype", dtype))
                fill = stored.type(np.nan if variable.fill is None else variable.fill)
                arguments = dict(zlib=False, complevel=4, shuffle=True, fletcher32=False, contiguous=False,
                                 chunksizes=None, endian="native", least_significant_digit=None, fill_value=fill)
                arguments.update(settings)
                if arguments["chunksizes"] is not None:  # no larger than the file's dims (CREDIT's write fails)
                    arguments["chunksizes"] = tuple(min(c, max(1, shapes[d])) for c, d in
                                                    zip(arguments["chunksizes"], variable.dims))
                created[name] = handle.createVariable(name, stored, variable.dims, **arguments)
                created[name].setncatts(dict(variable.attrs))
                chunking = created[name].chunking()
                sizes = [shapes[d] for d in variable.dims] if chunking == "contiguous" else list(chunking)
                chunks[name] = tuple(max(1, s) for s in sizes[1:]) if variable.picks is not None else (
                    1, max(1, sizes[1]), max(1, sizes[2]))
            else:
                values, attrs = coordinates[name]
                values = np.asarray(values)
                fill = values.dtype.type(np.nan) if values.dtype.kind == "f" else None
                created[name] = handle.createVariable(name, values.dtype, (name,), fill_value=fill)
                created[name].setncatts(attrs)
        for name in order:
            if name not in variables:
                created[name][:] = np.asarray(coordinates[name][0])
        # In data mode now: netCDF sized each variable's chunk cache for several chunks when it made it; with none,
        # a chunk goes to disk whole, once, and no chunk stays in memory after its write.
        for name in variables:
            created[name].set_var_chunk_cache(size=0, nelems=1, preemption=1.0)
    except BaseException:
        handle.close()
        raise
    return handle, chunks

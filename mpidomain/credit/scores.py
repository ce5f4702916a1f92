"""Latitude-weighted RMSE and ACC of forecasts by lead time and variable, from tiles: :class:`ForecastScores`.

The scores are CREDIT 2026.2.0's gen2 metrics (``credit.metrics.common.RMSEMetric``
and ``credit.metrics.anomaly.AnomalyCorrelationCoefficientMetric`` with
latitude weights), per forecast, per lead time and per variable: for each level
of a 3-D variable and for the variable as a whole (all levels, as CREDIT scores a
var_key), and for each 2-D variable. With ``w`` the rows' ``cos(latitude)`` over
its mean across the grid, and means over every element:

- ``RMSE = sqrt(mean(w * (forecast - truth)**2))``;
- ``ACC = mean(w * d_f * d_t) / (sqrt(mean(w * d_f**2) + eps) * sqrt(mean(w * d_t**2) + eps))``
  with the anomalies ``a = x - climatology`` debiased, ``d = a - mean(w * a)``,
  and ``eps = 1e-12`` as CREDIT.

Each rank sums its tile's rows (float64); one allgather over the domain group
brings every rank every row's sums, which each rank adds in the same order
(a row's column blocks in order, then the rows weighted): every rank gets the
whole field's value, the same on every rank; with whole rows on each rank
(latitude slabs) the same, bit for bit, as one process. The table averages
each score over the forecasts (init times) of every data-parallel group.
"""

import csv
import io
import math
import os
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np
import pandas as pd

from .._agreement import agree
from .._current import require_manager
from .._errors import digest
from ..manager import library_comm
from .output import OutputVariable, tile_extent, tile_values

__all__ = ["ForecastScores", "ScoreTable", "ScoreRow", "ClimatologyMean", "read_climatology", "latitude_weights",
           "ACC_EPSILON"]

ACC_EPSILON = 1e-12  # what CREDIT's AnomalyCorrelationCoefficientMetric adds under each square root
_COLUMNS = ("lead_hours", "variable", "level", "rmse", "acc", "forecasts")


def latitude_weights(latitude):
    """Return ``cos(latitude)`` over its mean across the grid's rows (float64): the rows' weights. Local."""
    latitude = np.asarray(latitude, dtype=np.float64)
    weights = np.cos(np.deg2rad(latitude))
    mean = weights.mean() if weights.size else 0.0
    if not mean > 0:
        raise ValueError(f"latitude_weights: the mean of cos(latitude) over {latitude.size} rows is {mean}, not "
                         "positive; pass the grid's latitudes in degrees")
    return weights / mean


@dataclass(frozen=True)
class ScoreRow:
    """One line of the table: a variable's (or one of its levels') mean scores at one lead time."""

    lead_hours: int
    variable: str
    level: str  # the level's value, "all" for the whole 3-D variable, "" for a 2-D variable
    rmse: float
    acc: float  # NaN without a climatology
    forecasts: int


@dataclass(frozen=True)
class ScoreTable:
    """The scores of every forecast (``records``: init time, lead hours, variable, level, rmse, acc) and their
    means by lead time and variable (``rows``, :class:`ScoreRow`)."""

    rows: Tuple[ScoreRow, ...]
    records: Tuple[Tuple[Any, ...], ...]

    def format(self):
        """Return the table as aligned text, one line per row, with a header."""
        lines = [f"{'lead (h)':>8}  {'variable':<24} {'level':>8}  {'rmse':>12}  {'acc':>8}  {'forecasts':>9}"]
        for row in self.rows:
            acc = "" if math.isnan(row.acc) else f"{row.acc:.4f}"
            lines.append(f"{row.lead_hours:>8}  {row.variable:<24} {row.level:>8}  {row.rmse:>12.6g}  {acc:>8}  "
                         f"{row.forecasts:>9}")
        return "\n".join(lines)

    def csv(self):
        """Return the table as CSV text: ``lead_hours,variable,level,rmse,acc,forecasts``."""
        stream = io.StringIO()
        writer = csv.writer(stream, lineterminator="\n")
        writer.writerow(_COLUMNS)
        for row in self.rows:
            writer.writerow([row.lead_hours, row.variable, row.level, repr(row.rmse),
                             "" if math.isnan(row.acc) else repr(row.acc), row.forecasts])
        return stream.getvalue()


def _values(array, channels, what):
    """``array`` as a floating (C, h, w) NumPy tile (:func:`~.output.tile_values`), or raise."""
    values = tile_values(array, channels, "ForecastScores.add", what)
    if values.dtype.kind != "f":
        raise TypeError(f"ForecastScores.add: {what} must be floating point, got {values.dtype}")
    return values


def _check_variables(variables):
    variables = tuple(variables)
    if not variables or not all(isinstance(v, OutputVariable) for v in variables):
        raise TypeError("variables must be a non-empty sequence of OutputVariable (the target layout: var_key and "
                        "levels of each predicted variable, in order)")
    return variables


def _lookup(table, variable):
    """``table``'s entry for ``variable``: by its var_key, else by its name (CREDIT's short name), else None."""
    if variable.key in table:
        return table[variable.key]
    return table.get(variable.name)


class ClimatologyMean:
    """A climatology computed from the data: the mean of the truth's tiles over a period, per grid point.

    Local (each rank its own tile; no communication): :meth:`add` each time's
    truth tile (the target layout's channels, as :meth:`ForecastScores.add`
    takes it), then :meth:`climatology` gives ``{var_key: (levels, h, w)}``
    for :class:`ForecastScores`. Sums are float64 in the order added, so every
    layout gives each grid point the same mean, bit for bit.
    """

    def __init__(self, variables):
        self._variables = _check_variables(variables)
        self._channels = sum(v.channels for v in self._variables)
        self._sum, self._count = None, 0

    def add(self, truth):
        """Add one time's truth tile."""
        values = _values(truth, self._channels, "truth")
        if self._sum is None:
            self._sum = np.zeros(values.shape, np.float64)
        elif values.shape != self._sum.shape:
            raise ValueError(f"ClimatologyMean.add: tiles must keep their shape, {self._sum.shape}, got {values.shape}")
        self._sum += values
        self._count += 1

    def climatology(self):
        """Return ``{var_key: the mean, (levels, h, w) float64}``; raise if nothing was added."""
        if not self._count:
            raise ValueError("ClimatologyMean.climatology: no truth was added; add the period's fields first")
        mean, out, first = self._sum / self._count, {}, 0
        for variable in self._variables:
            out[variable.key] = mean[first:first + variable.channels]
            first += variable.channels
        return out


def read_climatology(path, variables, latitude, longitude, manager=None):
    """Read this rank's part of a climatology file: ``{var_key: array broadcasting to its (levels, h, w) tile}``.

    Collective over the manager's job (every rank, the same arguments). The
    file (netCDF, or Zarr for a path ending ``.zarr``) holds a variable per
    predicted variable, named by its var_key or by the key's last part
    (CREDIT's climatology files), with any of the dims ``level`` (or
    ``levels``; the variable's levels are picked by value), ``latitude`` and
    ``longitude`` (the grid's: this rank's rows and columns are read); dims it
    lacks broadcast. So a per-grid-point climatology and the config's mean file
    (one value per level) both serve. A variable or level missing, or a grid
    that differs, raises the same ValueError on every rank.
    """
    import xarray as xr

    manager = require_manager(manager, "read_climatology", alone_ok=True)
    variables = _check_variables(variables)
    latitude, longitude = np.asarray(latitude), np.asarray(longitude)
    rows, columns = tile_extent(manager, (len(latitude), len(longitude)))
    out, error = {}, None
    try:
        opener = xr.open_zarr if os.fspath(path).rstrip("/").endswith(".zarr") else xr.open_dataset
        with opener(path) as data:
            for variable in variables:
                name = variable.key if variable.key in data.data_vars else variable.name
                if name not in data.data_vars:
                    raise ValueError(f"read_climatology: {path} has no variable {variable.name!r} (nor "
                                     f"{variable.key!r}); it has {sorted(map(str, data.data_vars))}")
                field = data[name]
                level_dim = next((d for d in ("level", "levels") if d in field.dims), None)
                extra = [d for d in field.dims if d not in ("latitude", "longitude", level_dim)]
                if extra:
                    raise ValueError(f"read_climatology: {path}: {name!r} has dims {field.dims}; a climatology has "
                                     "level, latitude and longitude only")
                if level_dim is not None:
                    if variable.levels is None:
                        raise ValueError(f"read_climatology: {path}: {name!r} has levels but {variable.key!r} is 2-D")
                    present = np.asarray(field[level_dim].values).tolist() if level_dim in field.coords else None
                    if present is None:
                        if field.sizes[level_dim] != len(variable.levels):
                            raise ValueError(f"read_climatology: {path}: {name!r} has {field.sizes[level_dim]} levels "
                                             f"without a coordinate, {variable.key!r} {len(variable.levels)}")
                    else:
                        missing = [lv for lv in variable.levels if lv not in present]
                        if missing:
                            raise ValueError(f"read_climatology: {path}: {name!r} has no level {missing[0]!r} (it "
                                             f"has {present})")
                        field = field.isel({level_dim: [present.index(lv) for lv in variable.levels]})
                for dim, grid, picked in (("latitude", latitude, rows), ("longitude", longitude, columns)):
                    if dim in field.dims:
                        if field.sizes[dim] != len(grid):
                            raise ValueError(f"read_climatology: {path}: {name!r} has {field.sizes[dim]} {dim}s, the "
                                             f"grid {len(grid)}")
                        field = field.isel({dim: slice(picked.start, picked.stop)})
                order = [d for d in (level_dim, "latitude", "longitude") if d is not None and d in field.dims]
                values = np.asarray(field.transpose(*order).values, dtype=np.float64)
                shape = (values.shape[0] if level_dim is not None else 1,
                         len(rows) if "latitude" in field.dims else 1, len(columns) if "longitude" in field.dims else 1)
                out[variable.key] = values.reshape(shape)
    except (OSError, ValueError, KeyError) as exc:
        error = exc if isinstance(exc, ValueError) else ValueError(f"read_climatology: {path}: {exc}")
    if manager is not None:
        agree(library_comm(manager, "world"), "read_climatology", None, error=error)
    elif error is not None:
        raise error
    return out


def _products(forecast, truth, forecast_means, truth_means):
    """Each row's sums of ``d_f d_t``, ``d_f**2``, ``d_t**2`` for anomalies debiased by per-channel means: (3, C, h)."""
    d_f = forecast - forecast_means[:, None, None]
    d_t = truth - truth_means[:, None, None]
    return np.stack([(d_f * d_t).sum(axis=-1), np.square(d_f).sum(axis=-1), np.square(d_t).sum(axis=-1)])


class ForecastScores:
    """Accumulate the scores of forecasts step by step from tiles; :meth:`finish` gives the table.

    Construction is collective over the job (every rank, once):
    ``variables`` is the target layout (:class:`~mpidomain.credit.output.OutputVariable`
    each, in order), ``latitude`` and ``longitude`` the whole grid's
    coordinates, ``climatology`` None (no ACC) or ``{var_key or name: array}``
    broadcasting to this rank's ``(levels, h, w)`` tile of each variable
    (:func:`read_climatology`, :class:`ClimatologyMean`).
    """

    def __init__(self, variables, latitude, longitude, manager=None, *, climatology=None):
        self._manager = manager = require_manager(manager, "ForecastScores", alone_ok=True)
        self._comm = None if manager is None else library_comm(manager, "domain")
        self._records, self._seen = [], set()
        error = description = None
        try:
            self._variables = _check_variables(variables)
            self._channels = sum(v.channels for v in self._variables)
            latitude, longitude = np.asarray(latitude), np.asarray(longitude)
            if latitude.ndim != 1 or longitude.ndim != 1:
                raise ValueError(f"ForecastScores: latitude and longitude must be the grid's 1-D coordinates, got "
                                 f"shapes {latitude.shape} and {longitude.shape}")
            self._shape = (len(latitude), len(longitude))
            self._rows, self._columns = tile_extent(manager, self._shape)
            self._weights = latitude_weights(latitude)
            self._climatology = None
            if climatology is not None:
                self._climatology = {}
                tile = (len(self._rows), len(self._columns))
                for variable in self._variables:
                    found = _lookup(climatology, variable)
                    if found is None:
                        raise ValueError(f"ForecastScores: the climatology has no {variable.key!r} (nor "
                                         f"{variable.name!r}); give one for every variable, or none (no ACC)")
                    found = np.asarray(found, dtype=np.float64)
                    try:
                        np.broadcast_shapes(found.shape, (variable.channels,) + tile)
                    except ValueError:
                        raise ValueError(f"ForecastScores: the climatology of {variable.key!r} has shape "
                                         f"{found.shape}, which does not broadcast to its tile "
                                         f"{(variable.channels,) + tile}") from None
                    self._climatology[variable.key] = found
            description = digest((repr(self._variables), latitude.tobytes(), longitude.tobytes(),
                                  climatology is None))
        except (ValueError, TypeError) as exc:
            error = exc
        if manager is not None:
            agree(library_comm(manager, "world"), "ForecastScores", description, error=error,
                  mismatch=lambda _: ValueError("ForecastScores needs the same variables and grid on every rank, and a "
                                                "climatology on all ranks or none"))
        elif error is not None:
            raise error

    def add(self, prediction, truth, init_time, lead_hours):
        """Score one step: this rank's tiles of the ``prediction`` and the ``truth`` at ``lead_hours``.

        Collective over the domain group: call on every rank of the group with
        its own tiles (torch or NumPy, physical units, the target layout's
        channels; (C, h, w), (B, C, h, w) or (B, C, 1, h, w), batch member 0)
        and the same ``init_time`` and ``lead_hours``. Every rank returns the
        same records of this step: ``(variable, level, rmse, acc)`` each.
        """
        error = forecast = observed = None
        key = (pd.Timestamp(init_time), int(lead_hours))
        try:
            forecast = _values(prediction, self._channels, "prediction")
            observed = _values(truth, self._channels, "truth")
            if forecast.shape[1:] != (len(self._rows), len(self._columns)) or observed.shape != forecast.shape:
                raise ValueError(f"ForecastScores.add: this rank's tile is {len(self._rows)} x {len(self._columns)} "
                                 f"(rows x columns of the {self._shape[0]} x {self._shape[1]} grid), got prediction "
                                 f"{forecast.shape} and truth {observed.shape}")
            if key in self._seen:
                raise ValueError(f"ForecastScores.add: the forecast from {key[0]} at {key[1]} h was scored already")
        except (ValueError, TypeError) as exc:
            error = exc
        if self._comm is not None:
            agree(self._comm, "ForecastScores.add", (str(key[0]), key[1]), error=error,
                  mismatch=lambda d: ValueError(f"ForecastScores.add needs the same init time and lead on every rank "
                                                f"of the domain group, got {d}"))
        elif error is not None:
            raise error
        self._seen.add(key)
        count = float(self._shape[0] * self._shape[1])
        # (3, C): the means of the squared error and of the two anomalies; then (6, C) the debiased products
        means = self._weighted(self._moments(forecast, observed, None)) / count
        second = None
        if self._climatology is not None:
            second = self._weighted(self._moments(forecast, observed, means)) / count
        records, offset = [], 0
        for variable in self._variables:
            channels = slice(offset, offset + variable.channels)
            offset += variable.channels
            levels = [""] if variable.levels is None else [str(level) for level in variable.levels]
            for i, level in enumerate(levels):
                c = channels.start + i
                acc = float("nan") if second is None else self._acc(second[0:3, c])
                records.append((variable.name, level, math.sqrt(means[0, c]), acc))
            if variable.levels is not None:
                mse = np.sum(means[0, channels]) / variable.channels
                # the whole variable's products are kept on its first channel, summed over its levels
                acc = float("nan") if second is None else self._acc(second[3:6, channels.start] / variable.channels)
                records.append((variable.name, "all", math.sqrt(mse), acc))
        self._records += [(key[0], key[1]) + record for record in records]
        return tuple(records)

    @staticmethod
    def _acc(moments):
        """ACC from the means of ``w d_f d_t``, ``w d_f**2`` and ``w d_t**2``."""
        covariance, forecast, truth = (float(m) for m in moments)
        return covariance / (math.sqrt(forecast + ACC_EPSILON) * math.sqrt(truth + ACC_EPSILON))

    def _moments(self, forecast, observed, means):
        """Each row's sums over this rank's columns, float64, per channel: (S, C, h).

        Without ``means``: squared error and the two anomalies (S = 3). With the first pass's ``means``: the
        products of the debiased anomalies, per level (S = 0..2) and, on a 3-D variable's first channel, for the
        whole variable (S = 3..5).
        """
        rows = len(self._rows)
        out = np.zeros((3 if means is None else 6, self._channels, rows), np.float64)
        offset = 0
        for variable in self._variables:
            channels = slice(offset, offset + variable.channels)
            offset += variable.channels
            p = forecast[channels].astype(np.float64)
            t = observed[channels].astype(np.float64)
            if means is None:
                out[0, channels] = np.square(p - t).sum(axis=-1)
            if self._climatology is None:
                continue
            climatology = self._climatology[variable.key]
            p -= climatology
            t -= climatology
            if means is None:
                out[1, channels] = p.sum(axis=-1)
                out[2, channels] = t.sum(axis=-1)
                continue
            out[0:3, channels] = _products(p, t, means[1, channels], means[2, channels])
            if variable.levels is not None:  # debiased by the whole variable's means, summed over its levels
                whole = [np.full(variable.channels, np.sum(means[k, channels]) / variable.channels) for k in (1, 2)]
                out[3:6, channels.start] = _products(p, t, *whole).sum(axis=1)
        return out

    def _weighted(self, partial):
        """The grid's weighted sums of every row's ``partial`` sums: (S, C), alike on every rank of the group."""
        if self._comm is None:
            full = partial  # one process: every row
        else:
            gathered = self._comm.allgather((self._rows.start, self._columns.start, partial))
            full = np.zeros(partial.shape[:2] + (self._shape[0],), np.float64)
            for start in sorted({g[0] for g in gathered}):
                blocks = sorted((g for g in gathered if g[0] == start), key=lambda g: g[1])
                block = blocks[0][2]
                for extra in blocks[1:]:
                    block = block + extra[2]
                full[:, :, start:start + block.shape[-1]] = block
        return (full * self._weights).sum(axis=-1)

    def finish(self, csv_path=None):
        """Return the :class:`ScoreTable` of every forecast scored by every data-parallel group; write the CSV.

        Collective over the job: every rank calls it once, at the end, and
        gets the same table: each score averaged over the forecasts (init
        times) at each lead time, in the target layout's order. With
        ``csv_path``, world rank 0 writes it there (under a temporary name,
        then renamed); a failure raises the same error on every rank.
        """
        records = list(self._records)
        if self._manager is not None:
            gathered = library_comm(self._manager, "data").allgather(records)
            records = [record for group in gathered for record in group]
        order = {}
        for variable in self._variables:
            for level in ([""] if variable.levels is None else [str(lv) for lv in variable.levels] + ["all"]):
                order[(variable.name, level)] = len(order)
        records.sort(key=lambda r: (r[1], order[(r[2], r[3])], r[0]))
        rows, index = [], 0
        while index < len(records):
            end = index
            while end < len(records) and records[end][1:4] == records[index][1:4]:
                end += 1
            group = records[index:end]
            rows.append(ScoreRow(int(group[0][1]), group[0][2], group[0][3],
                                 float(np.mean([r[4] for r in group])), float(np.mean([r[5] for r in group])),
                                 len(group)))
            index = end
        table = ScoreTable(tuple(rows), tuple(records))
        if csv_path is not None:
            error = None
            world = None if self._manager is None else library_comm(self._manager, "world")
            if world is None or world.Get_rank() == 0:
                try:
                    folder = os.path.dirname(os.fspath(csv_path)) or "."
                    os.makedirs(folder, exist_ok=True)
                    partial = os.fspath(csv_path) + ".partial"
                    with open(partial, "w") as stream:
                        stream.write(table.csv())
                    os.replace(partial, csv_path)
                except OSError as exc:
                    error = exc
            if world is not None:
                agree(world, "ForecastScores.finish", None, error=error)
            elif error is not None:
                raise error
        return table

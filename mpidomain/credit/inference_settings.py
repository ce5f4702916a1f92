"""A gen2 config's ``inference`` block, read as CREDIT 2026.2.0's ``credit rollout`` does: :class:`InferenceSettings`.

Pure: it reads the config dict and nothing else (no file, no MPI), so every
rank reads the same settings and raises the same :class:`~mpidomain.command.UsageError`
for a key it does not honour or a bad value, one line naming the key and the
value. Keys CREDIT reads elsewhere or not at all are left alone.
"""

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

import pandas as pd

from ..command import UsageError

__all__ = ["InferenceSettings", "OutputSettings", "read_inference_settings", "GROUP_BY", "MODES",
           "NETCDF_SETTINGS", "NETCDF_VARIABLE_SETTINGS"]

MODES = ("none", "ddp", "fsdp")
#: ``output.group_by`` as CREDIT spells it (case-insensitive), and the period each names.
GROUP_BY = {"1d": "day", "d": "day", "day": "day", "daily": "day", "1m": "month", "m": "month", "month": "month",
            "monthly": "month", "1y": "year", "y": "year", "year": "year", "yearly": "year", "full": "full"}
#: The netCDF settings ``output.encoding`` may give for every variable (CREDIT's scalar keys).
NETCDF_SETTINGS = ("dtype", "zlib", "complevel", "shuffle", "chunksizes", "fletcher32", "contiguous")
#: What one variable's entry of ``output.encoding`` may set: those, and its ``_FillValue``.
NETCDF_VARIABLE_SETTINGS = NETCDF_SETTINGS + ("_FillValue",)
_STANDARD_CALENDARS = ("standard", "gregorian", "proleptic_gregorian")
_FLOAT_DTYPES = ("float16", "float32", "float64")


@dataclass(frozen=True)
class OutputSettings:
    """``inference.output``: what the forecast files hold and how they are cut.

    :param format: ``"netcdf"`` or ``"zarr"``.
    :param interval_hours: Write only the steps whose lead time (hours) is a multiple of this; None: every step.
    :param group_by: One file per ``"step"``, or per ``"day"``, ``"month"``, ``"year"`` of valid time, or
        ``"full"`` (one file per forecast).
    :param variables: The variables to write, ``(var_key, levels or None)`` each (None: all levels), in the
        config's order; None: every predicted variable.
    :param metadata: The CF attributes file as the config names it (a bare file name is one of CREDIT's own,
        ``credit/metadata/``), or None.
    :param encoding: The netCDF settings for every data variable (:data:`NETCDF_SETTINGS`).
    :param variable_encoding: ``(name, settings)`` pairs: one variable's netCDF settings (by its short name or
        var_key), applied after ``encoding``.
    """

    format: str = "netcdf"
    interval_hours: Optional[int] = None
    group_by: str = "step"
    variables: Optional[Tuple[Tuple[str, Optional[Tuple[Any, ...]]], ...]] = None
    metadata: Optional[str] = None
    encoding: Mapping[str, Any] = field(default_factory=dict)
    variable_encoding: Tuple[Tuple[str, Mapping[str, Any]], ...] = ()

    @property
    def extension(self):
        """The files' extension: ``.nc`` or ``.zarr``."""
        return ".nc" if self.format == "netcdf" else ".zarr"

    def netcdf_settings(self, name, var_key=None):
        """Return the netCDF settings of the data variable ``name`` (with ``var_key``): ``encoding``, then its own."""
        settings = dict(self.encoding)
        for key, own in self.variable_encoding:
            if key in (name, var_key) or key.split("/")[-1] == name:
                settings.update(own)
        return settings


@dataclass(frozen=True)
class InferenceSettings:
    """What ``credit rollout`` does with a gen2 config: the forecasts to run and the files to write.

    :param mode: ``inference.mode`` (none, ddp or fsdp): how CREDIT spreads a forecast; required, as CREDIT
        requires it.
    :param run_mode: ``"batch"`` (``batch_forecast``'s init times) or ``"single"`` (``single_forecast``'s).
    :param save_forecast: The folder the forecast files go under (environment variables expanded).
    :param init_times: The init times, sorted, without repeats.
    :param steps: Model steps per forecast (``forecast_length`` over the data's ``timestep``).
    :param timestep: The data's ``timestep``.
    :param step_hours: Hours per model step (the lead time of step ``k`` is ``k * step_hours``).
    :param calendar: The data's calendar (``data.calendar``, default ``standard``).
    :param output: ``inference.output`` (:class:`OutputSettings`).
    :param data: The ``data`` block the rollout reads (``inference.data`` where given, else the top level's).
    :param preblocks: The ``preblocks`` block the rollout runs (``inference.preblocks`` where given).
    :param postblocks: The ``postblocks`` block the rollout runs (``inference.postblocks`` where given).
    :param training_data: The top-level ``data`` block (the model's channel layout, when no saved schema).
    :param overridden: Which of ``data``, ``preblocks``, ``postblocks`` the ``inference`` block replaced.
    """

    mode: str
    run_mode: str
    save_forecast: str
    init_times: Tuple[pd.Timestamp, ...]
    steps: int
    timestep: pd.Timedelta
    step_hours: int
    calendar: str
    output: OutputSettings
    data: Mapping[str, Any]
    preblocks: Optional[Mapping[str, Any]]
    postblocks: Optional[Mapping[str, Any]]
    training_data: Mapping[str, Any]
    overridden: Tuple[str, ...] = ()

    def valid_time(self, init_time, step):
        """Return the valid time of model step ``step`` (1 to :attr:`steps`) of the forecast from ``init_time``."""
        return pd.Timestamp(init_time) + pd.Timedelta(hours=step * self.step_hours)


def _bad(key, value, expected):
    return UsageError(f"inference config: {key}: {value!r} {expected}")


def _mapping(value, key):
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(key, value, "must be a mapping of keys to values")
    return value


def _timestamp(value, key):
    try:
        stamp = pd.Timestamp(value)
    except (TypeError, ValueError) as exc:
        raise _bad(key, value, f"is not a date and time ({exc}); e.g. '2020-01-01T00'") from None
    if stamp is pd.NaT:
        raise _bad(key, value, "is not a date and time; e.g. '2020-01-01T00'")
    if stamp.tzinfo is not None:
        raise _bad(key, value, "has a time zone; give times without one (UTC), e.g. '2020-01-01T00'")
    return stamp


def _duration(value, key):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise _bad(key, value, "is a bare number (pandas, so CREDIT, reads it as nanoseconds); give a duration such "
                               "as '24h' or '1d'")
    if isinstance(value, str):  # CREDIT's configs write days as "1d", which pandas is retiring for "1D"
        value = re.sub(r"(?<=\d)d$", "D", value.strip())
    try:
        duration = pd.Timedelta(value)
    except (TypeError, ValueError) as exc:
        raise _bad(key, value, f"is not a duration ({exc}); e.g. '6h' or '1d'") from None
    if duration is pd.NaT:
        raise _bad(key, value, "is not a duration; e.g. '6h' or '1d'")
    return duration


def _required(block, key, where):
    if key not in block:
        raise UsageError(f"inference config: {where}.{key} is required (CREDIT's credit rollout needs it too)")
    return block[key]


def _init_times(inference, run_mode, init_time):
    """The init times and the ``forecast_length`` (with its key) of ``run_mode``, as CREDIT builds them."""
    batch = _mapping(inference.get("batch_forecast"), "inference.batch_forecast")
    if run_mode == "single":
        single = _mapping(inference.get("single_forecast"), "inference.single_forecast")
        if init_time is None:
            init_time = _required(single, "start_datetime", "inference.single_forecast")
            where = "inference.single_forecast.start_datetime"
        else:
            where = "--init-time"
        times = [_timestamp(init_time, where)]
        if "forecast_length" in single:
            return times, single["forecast_length"], "inference.single_forecast.forecast_length"
        if "forecast_length" in batch:
            return times, batch["forecast_length"], "inference.batch_forecast.forecast_length"
        return times, "10d", "the default forecast_length"
    if "batch_forecast" not in inference:
        raise UsageError("inference config: inference.batch_forecast is required for run_mode batch (or give "
                         "inference.single_forecast.start_datetime with run_mode single)")
    where = "inference.batch_forecast"
    first = _timestamp(_required(batch, "first_init_date", where), f"{where}.first_init_date")
    last = _timestamp(_required(batch, "last_init_date", where), f"{where}.last_init_date")
    interval = _duration(_required(batch, "init_interval", where), f"{where}.init_interval")
    if interval <= pd.Timedelta(0):
        raise _bad(f"{where}.init_interval", batch["init_interval"], "must be a positive duration, e.g. '1d'")
    if last < first:
        raise UsageError(f"inference config: {where}.last_init_date {batch['last_init_date']!r} is before "
                         f"first_init_date {batch['first_init_date']!r}: no forecast to run")
    count = (last - first) // interval + 1
    times = [first + k * interval for k in range(count)]
    return times, _required(batch, "forecast_length", where), f"{where}.forecast_length"


def _variables(entries):
    """``output.variables`` as ``((var_key, levels or None), ...)``, or None."""
    key = "inference.output.variables"
    if entries is None:
        return None
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise _bad(key, entries, "must be a list of var_keys (e.g. 'ERA5/prognostic/3d/temperature') or of "
                                 "{name: var_key, levels: [...]}")
    found, seen = [], set()
    for entry in entries:
        if isinstance(entry, Mapping):
            if "name" not in entry:
                raise _bad(key, entry, "has no 'name': give {name: var_key, levels: [...]}")
            name, levels = entry["name"], entry.get("levels")
            if levels is not None:
                if isinstance(levels, (str, bytes)) or not isinstance(levels, (list, tuple)) or not levels:
                    raise _bad(f"{key}[{name}].levels", levels, "must be a non-empty list of levels")
                levels = tuple(levels)
        else:
            name, levels = entry, None
        if not isinstance(name, str) or not name:
            raise _bad(key, entry, "must name a var_key, e.g. 'ERA5/prognostic/3d/temperature'")
        if name in seen:
            raise _bad(key, name, "is listed twice")
        seen.add(name)
        found.append((name, levels))
    if not found:
        raise _bad(key, entries, "is empty: list the variables to write, or leave it out to write every one")
    return tuple(found)


def _check_netcdf_settings(settings, where, allowed):
    """Check one set of netCDF settings; return it as a plain dict."""
    checked = {}
    for name, value in settings.items():
        key = f"{where}.{name}"
        if name not in allowed:
            raise _bad(key, value, f"is not a netCDF setting mpidomain writes (it honours {', '.join(allowed)})")
        if name in ("zlib", "shuffle", "fletcher32", "contiguous") and not isinstance(value, bool):
            raise _bad(key, value, "must be true or false")
        if name == "complevel" and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9):
            raise _bad(key, value, "must be an integer from 0 to 9")
        if name == "dtype" and str(value) not in _FLOAT_DTYPES:
            raise _bad(key, value, f"must be one of {', '.join(_FLOAT_DTYPES)} (the forecast is floating point)")
        if name == "chunksizes" and (not isinstance(value, (list, tuple)) or not value or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in value)):
            raise _bad(key, value, "must be a list of positive integers, one per dim of the variable")
        if name == "_FillValue" and value is not None and (isinstance(value, bool) or
                                                           not isinstance(value, (int, float))):
            raise _bad(key, value, "must be a number")
        checked[name] = tuple(value) if name == "chunksizes" else str(value) if name == "dtype" else value
    if checked.get("contiguous") and (checked.get("zlib") or checked.get("chunksizes")):
        raise _bad(f"{where}.contiguous", True, "cannot be combined with zlib or chunksizes (a contiguous "
                                                "variable is neither chunked nor compressed)")
    return checked


def _output(block, steps, step_hours):
    where = "inference.output"
    block = _mapping(block, where)
    fmt = block.get("format") or "netcdf"
    if not isinstance(fmt, str) or fmt.lower().strip() not in ("netcdf", "zarr"):
        raise _bad(f"{where}.format", fmt, "must be netcdf or zarr")
    interval = block.get("output_interval")
    hours = None
    if interval:
        duration = _duration(interval, f"{where}.output_interval")
        hours = int(duration.total_seconds() / 3600)
        if hours < 1 or duration != pd.Timedelta(hours=hours):
            raise _bad(f"{where}.output_interval", interval, "must be a whole number of hours, at least 1, "
                                                             "e.g. '6h' or '1d'")
        if hours > steps * step_hours:
            raise _bad(f"{where}.output_interval", interval,
                       f"is longer than the forecast ({steps * step_hours} h): no step would be written")
    group_by = block.get("group_by")
    if group_by is None:
        group = "step"
    elif str(group_by).lower().strip() in GROUP_BY:
        group = GROUP_BY[str(group_by).lower().strip()]
    else:
        raise _bad(f"{where}.group_by", group_by, f"must be null or one of {', '.join(sorted(GROUP_BY))}")
    metadata = block.get("metadata")
    if metadata is not None and (not isinstance(metadata, str) or not metadata):
        raise _bad(f"{where}.metadata", metadata, "must be a file name (CREDIT's, e.g. era5.yaml) or a path")
    encoding = _mapping(block.get("encoding"), f"{where}.encoding")
    common = {k: v for k, v in encoding.items() if k in NETCDF_SETTINGS}
    common = _check_netcdf_settings(common, f"{where}.encoding", NETCDF_SETTINGS)
    own = []
    for name, value in encoding.items():
        if name in NETCDF_SETTINGS:
            continue
        if not isinstance(value, Mapping):
            raise _bad(f"{where}.encoding.{name}", value,
                       f"is neither a netCDF setting mpidomain writes ({', '.join(NETCDF_SETTINGS)}) nor one "
                       "variable's settings (a mapping, keyed by the variable's name)")
        own.append((str(name), _check_netcdf_settings(value, f"{where}.encoding.{name}",
                                                      NETCDF_VARIABLE_SETTINGS)))
    return OutputSettings(fmt.lower().strip(), hours, group, _variables(block.get("variables")),
                          None if metadata is None else os.path.expandvars(metadata), common, tuple(own))


def read_inference_settings(conf, *, save_dir=None, init_time=None, run_mode=None):
    """Return the :class:`InferenceSettings` of the gen2 config ``conf`` (a dict, as read from its YAML).

    Reads ``inference`` as CREDIT 2026.2.0's ``credit rollout`` does: ``mode``
    (required), ``run_mode`` (batch, single), ``save_forecast``,
    ``batch_forecast`` (``first_init_date`` to ``last_init_date`` inclusive,
    every ``init_interval``; ``forecast_length`` a duration such as ``"10d"``,
    over ``data.timestep``) or ``single_forecast`` (``start_datetime``),
    ``output`` (``format``, ``output_interval``, ``group_by``, ``variables``,
    ``metadata``, ``encoding``) and the ``data``, ``preblocks`` and
    ``postblocks`` blocks that each replace the top level's wholly. Where
    CREDIT would fail late, silently or never stop (a non-positive
    ``init_interval``, an ``output_interval`` of zero hours, an unknown encoding
    key), this raises first. ``save_dir``, ``init_time`` and ``run_mode`` are
    the command line's overrides (``init_time`` implies single). Local and
    deterministic: every rank given the same config raises the same
    :class:`~mpidomain.command.UsageError`.
    """
    if not isinstance(conf, Mapping):
        raise UsageError(f"inference config: the config must be a mapping (a YAML file of keys), got "
                         f"{type(conf).__name__}")
    if "inference" not in conf or not isinstance(conf["inference"], Mapping):
        raise UsageError("inference config: the config has no 'inference' block (mode, save_forecast, "
                         "batch_forecast, output); add one, as in CREDIT's example-end-to-end.yml")
    inference = conf["inference"]
    mode = _required(inference, "mode", "inference")
    if mode not in MODES:
        raise _bad("inference.mode", mode, f"must be one of {', '.join(MODES)}")
    if init_time is not None:
        run_mode = "single"
    run_mode = run_mode if run_mode is not None else inference.get("run_mode", "batch")
    if run_mode not in ("batch", "single"):
        raise _bad("inference.run_mode", run_mode, "must be batch or single")
    save = save_dir if save_dir is not None else _required(inference, "save_forecast", "inference")
    if not isinstance(save, (str, os.PathLike)) or not os.fspath(save):
        raise _bad("inference.save_forecast", save, "must be a folder's path")
    training_data = _mapping(conf.get("data"), "data")
    blocks, overridden = {}, []
    for name in ("data", "preblocks", "postblocks"):  # each replaces the top level's wholly; null: no override
        block, key = inference.get(name), f"inference.{name}"
        if block is None:
            block, key = conf.get(name), name
        else:
            overridden.append(name)
        blocks[name] = None if block is None else _mapping(block, key)
    data = blocks["data"] or {}
    where = "inference.data" if "data" in overridden else "data"
    if not isinstance(data.get("source"), Mapping):
        raise UsageError(f"inference config: {where}.source is required: credit rollout reads gen2 configs, whose data "
                         "block names its sources (data.source.<name>.variables, levels, paths)")
    timestep = _duration(_required(data, "timestep", where), f"{where}.timestep")
    step_hours = int(timestep.total_seconds() / 3600)
    if step_hours < 1 or timestep != pd.Timedelta(hours=step_hours):
        raise _bad(f"{where}.timestep", data["timestep"], "must be a whole number of hours (CREDIT names and "
                                                          "times its output by the hour)")
    calendar = data.get("calendar", "standard")
    if calendar not in _STANDARD_CALENDARS:
        raise _bad(f"{where}.calendar", calendar, f"is not supported by mpidomain's rollout (it handles "
                                                  f"{', '.join(_STANDARD_CALENDARS)})")
    times, length, length_key = _init_times(inference, run_mode, init_time)
    total = _duration(length, length_key)
    steps = int(total / timestep)
    if steps <= 0:
        raise _bad(length_key, length, f"is shorter than one timestep ({data['timestep']})")
    output = _output(inference.get("output"), steps, step_hours)
    return InferenceSettings(mode=mode, run_mode=run_mode, save_forecast=os.path.expandvars(os.fspath(save)),
                             init_times=tuple(sorted(set(times))), steps=steps, timestep=timestep,
                             step_hours=step_hours, calendar=calendar, output=output, data=data,
                             preblocks=blocks["preblocks"], postblocks=blocks["postblocks"],
                             training_data=training_data, overridden=tuple(overridden))

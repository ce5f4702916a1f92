"""CREDIT's forecast files written from tiles (mpidomain.credit.output) and the inference block that sets them.

Every rank holds its tile of seeded forecasts and writes them with ForecastWriter on every layout of the
world's ranks (latitude slabs, tiles, data-parallel groups that split the init times); rank 0 writes the
same arrays with CREDIT's own ``credit.output_gen2.ForecastWriter`` in one process and compares every
file: names, dims, variables in order, dtypes, chunks, compression, attributes and values (bitwise: no
arithmetic happens on the way). The only differences allowed are the ones mpidomain makes on purpose: the
metadata's attributes on the ERA5 long names (``temperature`` gets CREDIT's ``T`` attributes) and the
metadata's ``_FillValue`` in netCDF as in Zarr. Then: the schedule of files, the inference block's keys and
bad values, mistakes raised alike on every rank, a killed job's files, and the netCDF writer's peak memory.
"""

import base64
import json
import os
import re
import textwrap
import types

import numpy as np
import pandas as pd
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
netCDF4 = pytest.importorskip("netCDF4")
pytest.importorskip("zarr")
pytest.importorskip("yaml")

import mpitest  # noqa: E402

from mpidomain import DomainParallelManager, balanced_split  # noqa: E402
from mpidomain.command import UsageError  # noqa: E402
from mpidomain.credit.inference_settings import OutputSettings, read_inference_settings  # noqa: E402
from mpidomain.credit.output import (PARTIAL, ForecastWriter, OutputVariable, forecast_files,  # noqa: E402
                                     load_metadata)

GRID = (13, 24)  # uneven over 2 and 4 ranks
LEVELS = (500, 850)
LAYOUT = (("ERA5/prognostic/3d/T", LEVELS), ("ERA5/prognostic/3d/temperature", LEVELS),
          ("ERA5/prognostic/2d/SP", None), ("ERA5/diagnostic/2d/tp", None))
FIRST_INIT = "2020-01-01T12"
STEPS = 5  # 6-hourly from 12Z: the valid times cross midnight


def base_config(save, output, **inference):
    """A gen2 config's keys the writer needs: two init times a day apart, 5 steps of 6 h."""
    return {"data": {"source": {"ERA5": {"levels": list(LEVELS)}}, "timestep": "6h"},
            "inference": {"mode": "none", "save_forecast": save, "output": output,
                          "batch_forecast": {"first_init_date": FIRST_INIT, "last_init_date": "2020-01-02T12",
                                             "init_interval": "1d", "forecast_length": f"{6 * STEPS}h"},
                          **inference}}


# name: (output block, target layout)
CASES = {
    "netcdf": ({"format": "netcdf", "output_interval": "12h", "metadata": "era5.yaml",
                "encoding": {"zlib": True, "complevel": 4}}, LAYOUT),
    "netcdf-day-chunks": ({"format": "netcdf", "group_by": "day", "metadata": "era5.yaml",
                           "encoding": {"zlib": True, "complevel": 4, "T": {"chunksizes": [1, 1, 5, 7]},
                                        "SP": {"chunksizes": [1, 4, 9]}}}, LAYOUT),
    "netcdf-2d-first-picked": ({"format": "netcdf",
                                "variables": ["ERA5/prognostic/2d/SP",
                                              {"name": "ERA5/diagnostic/3d/w", "levels": [850]}]},
                               (("ERA5/prognostic/2d/SP", None), ("ERA5/diagnostic/3d/w", LEVELS))),
    "zarr": ({"format": "zarr", "metadata": "era5.yaml"}, LAYOUT),
    "zarr-day-interval": ({"format": "zarr", "group_by": "day", "output_interval": "12h", "metadata": "era5.yaml"},
                          LAYOUT),
}


def channels_of(layout):
    return sum(1 if levels is None else len(levels) for _, levels in layout)


def field(case, init_index, step, layout):
    """The whole forecast field of a step, (C, H, W) float32, the same on every rank."""
    seed = sum(map(ord, case))
    rng = np.random.default_rng((seed, init_index, step))
    return (rng.standard_normal((channels_of(layout),) + GRID) * 10 + 250).astype(np.float32)


def grid_coordinates():
    return np.linspace(90, -90, GRID[0]), np.arange(GRID[1]) * (360.0 / GRID[1])


def tile_of(values, manager):
    grid = (tuple(manager.domain_shape) + (1,))[:2]
    coords = (tuple(manager.domain_coords) + (0,))[:2]
    cuts = []
    for n, parts, c in zip(GRID, grid, coords):
        counts, offsets = balanced_split(n, parts)
        cuts.append(slice(offsets[c], offsets[c] + counts[c]))
    return values[..., cuts[0], cuts[1]]


@pytest.fixture(scope="module")
def layouts():
    """Every layout the world's ranks test: slabs over all ranks, tiles (1 x 2 at 2 ranks, 2 x 2 at 4), and
    half the ranks per domain group (2 data-parallel groups splitting the init times)."""
    world = MPI.COMM_WORLD
    built = [(f"D{world.size}", DomainParallelManager(world.size, world.size))]
    tiles = {2: (1, 2), 4: (2, 2)}.get(world.size)
    if tiles:
        built.append((f"{tiles[0]}x{tiles[1]}", DomainParallelManager(world.size, tiles, (-2, -1))))
    if world.size % 2 == 0:
        built.append((f"D{world.size // 2}x2groups", DomainParallelManager(world.size, world.size // 2)))
    yield built
    for _, manager in built:
        manager.close()


@pytest.fixture
def shared(world, tmp_path):
    """A folder every rank writes into: rank 0's temporary folder."""
    return world.bcast(str(tmp_path) if world.rank == 0 else None)


def write_ours(case, manager, save):
    """Every domain group writes its init times (the data-parallel groups split them) with ForecastWriter."""
    output, layout = CASES[case]
    settings = read_inference_settings(base_config(save, output))
    latitude, longitude = grid_coordinates()
    writer = ForecastWriter(settings.output, [OutputVariable(k, lv) for k, lv in layout], latitude, longitude,
                            settings.save_forecast, steps=settings.steps, step_hours=settings.step_hours,
                            calendar=settings.calendar, manager=manager)
    dp_rank, dp_size = manager.data_parallel_coords()
    for index, init in enumerate(settings.init_times):
        if index % dp_size != dp_rank:
            continue
        for step in range(1, settings.steps + 1):
            writer.write(tile_of(field(case, index, step, layout), manager), init, step)
    return writer.finish()


def write_credit(case, save):
    """CREDIT's own writer in this process, on the same arrays."""
    from credit.datasets.gen_2.grid_utils import GridSchema
    from credit.output_gen2 import ForecastWriter as CreditWriter

    output, layout = CASES[case]
    conf = base_config(save, output)
    settings = read_inference_settings(conf)
    latitude, longitude = grid_coordinates()
    writer = CreditWriter(output, conf, n_steps=settings.steps, grid_schema=GridSchema("rectilinear", latitude,
                                                                                        longitude),
                          dataset=types.SimpleNamespace(calendar="standard"), verbose=False)
    import torch

    for index, init in enumerate(settings.init_times):
        for step in range(1, settings.steps + 1):
            values, state, first = torch.from_numpy(field(case, index, step, layout)), {}, 0
            for key, levels in layout:
                n = 1 if levels is None else len(levels)
                state[key] = values[None, first:first + n, None]
                first += n
            writer({"ERA5": state}, init, step, settings.step_hours, save, None)
    writer.flush()


def tree(folder):
    """The files and stores under ``folder``: relative paths of ``*.nc`` files and ``*.zarr`` folders, and any
    other file or folder at the level of the forecasts (a ``.partial`` left behind would show)."""
    found = []
    for init in sorted(os.listdir(folder)):
        found += [os.path.join(init, name) for name in sorted(os.listdir(os.path.join(folder, init)))]
    return found


def nc_summary(path):
    """Everything of a netCDF file but its values: (global, dims, [(name, dtype, dims, chunking, filters, endian,
    attrs)]); attrs as (name, repr) lists, in order."""
    with netCDF4.Dataset(path) as ds:
        variables = [(name, str(v.dtype), v.dimensions, v.chunking(), v.filters(), v.endian(),
                      [(a, repr(v.getncattr(a))) for a in v.ncattrs()]) for name, v in ds.variables.items()]
        return (ds.data_model, [(a, repr(ds.getncattr(a))) for a in ds.ncattrs()],
                [(n, len(d), d.isunlimited()) for n, d in ds.dimensions.items()], variables)


def nc_values(path):
    with netCDF4.Dataset(path) as ds:
        ds.set_auto_maskandscale(False)
        return {name: np.asarray(v[...]) for name, v in ds.variables.items()}


def nc_repr(value):
    """A metadata value as netCDF4 reads its attribute back, repr'd (strings stay strings, numbers NumPy's)."""
    return repr(value) if isinstance(value, str) else repr(np.asarray(value)[()])


def zarr_fill(value):
    """A float32 variable's _FillValue ``value`` as xarray stores it in Zarr attributes."""
    return base64.b64encode(np.float64(np.float32(value)).tobytes()).decode()


def compare_netcdf(ours, theirs, metadata):
    """The differences of two netCDF files, beyond the intended ones."""
    a, b = nc_summary(ours), nc_summary(theirs)
    problems = [f"{what} differ: {x} vs {y}" for what, x, y in zip(("data model", "global attributes", "dims"),
                                                                     a[:3], b[:3]) if x != y]
    if [v[0] for v in a[3]] != [v[0] for v in b[3]]:
        problems.append(f"variables (in order) differ: {[v[0] for v in a[3]]} vs {[v[0] for v in b[3]]}")
    for mine, credit in zip(a[3], b[3]):
        name = credit[0]
        if mine[:6] != credit[:6]:
            problems.append(f"{name}: dtype, dims, chunks, filters or endianness differ: {mine[:6]} vs {credit[:6]}")
        want = credit[6]
        if name not in ("time", "level", "latitude", "longitude") and metadata:
            entry = metadata.get(name) or metadata.get(GEN1.get(name), None)
            if entry is not None:
                fill = repr(np.float32(entry["_FillValue"])) if "_FillValue" in entry else dict(credit[6])["_FillValue"]
                want = [("_FillValue", fill)] + [(k, nc_repr(v)) for k, v in entry.items() if k != "_FillValue"]
        if mine[6] != want:
            problems.append(f"{name}: attributes {mine[6]}, expected {want}")
    got, ref = nc_values(ours), nc_values(theirs)
    for name in ref:
        if not np.array_equal(got[name], ref[name]):
            problems.append(f"{name}: values differ")
    return problems


GEN1 = {"temperature": "T", "specific_humidity": "Q", "u_component_of_wind": "U", "v_component_of_wind": "V",
        "geopotential": "Z", "surface_pressure": "SP", "2m_temperature": "t2m", "pressure": "P"}


def zarr_files(path):
    found = {}
    for root, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as handle:
                found[os.path.relpath(os.path.join(root, name), path)] = handle.read()
    return found


def compare_zarr(ours, theirs, metadata):
    """The differences of two Zarr stores, beyond the intended ones, file by file (chunks byte for byte)."""
    mine, credit = zarr_files(ours), zarr_files(theirs)
    problems = [f"files only in one store: {sorted(set(mine) ^ set(credit))}"] if set(mine) != set(credit) else []

    def expected(name, document):
        entry = metadata.get(name) or metadata.get(GEN1.get(name), None)
        if entry is None or document.get("node_type") != "array" or name in ("time", "latitude", "longitude"):
            return document
        document = json.loads(json.dumps(document))
        reference = document["attributes"]
        fill = reference["_FillValue"] if "_FillValue" not in entry else zarr_fill(entry["_FillValue"])
        document["attributes"] = {**{k: v for k, v in entry.items() if k != "_FillValue"}, "_FillValue": fill}
        return document

    for name in sorted(set(mine) & set(credit)):
        if name.endswith("zarr.json"):
            got, want = json.loads(mine[name]), json.loads(credit[name])
            variable = os.path.dirname(name)
            want = expected(variable, want)
            if "consolidated_metadata" in want:
                want["consolidated_metadata"]["metadata"] = {
                    k: expected(k, v) for k, v in want["consolidated_metadata"]["metadata"].items()}
            if got != want:
                problems.append(f"{name}: {got} vs expected {want}")
        elif mine[name] != credit[name]:
            problems.append(f"chunk file {name} differs")
    return problems


_REFERENCES = {}


@pytest.mark.credit
@pytest.mark.parametrize("case", sorted(CASES))
def test_files_equal_credits_own_writer(world, layouts, shared, case):
    """On every layout, ForecastWriter's files are CREDIT's, file for file: the same names, dims, variables,
    chunks, compression, attributes (but the intended ones) and values, bit for bit; no .partial left."""
    mpitest.import_credit("credit.output_gen2")
    problems = []
    reference = os.path.join(shared, "credit")
    if world.rank == 0:
        write_credit(case, reference)
    metadata = load_metadata(CASES[case][0].get("metadata"))
    for label, manager in layouts:
        save = os.path.join(shared, label)
        written = write_ours(case, manager, save)
        everyone = world.allgather(list(written))
        if world.rank != 0:
            continue
        names = tree(save)
        if names != tree(reference):
            problems.append(f"{label}: files {names}, CREDIT's {tree(reference)}")
            continue
        completed = sorted({os.path.relpath(p, save) for group in everyone for p in group})
        if completed != names:
            problems.append(f"{label}: ForecastWriter reported {completed}, wrote {names}")
        for name in names:
            compare = compare_netcdf if name.endswith(".nc") else compare_zarr
            problems += [f"{label} {name}: {p}" for p in compare(os.path.join(save, name),
                                                                  os.path.join(reference, name), metadata)]
    problems = mpitest.share(world, problems)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.credit
def test_the_temperature_gets_credits_T_attributes_and_one_fill_value(world, shared):
    """ERA5's long names get the attributes CREDIT's metadata keeps under the gen1 names, and the metadata's
    _FillValue is the netCDF file's as the Zarr store's (CREDIT drops it from netCDF)."""
    mpitest.import_credit()  # its metadata/era5.yaml
    manager = DomainParallelManager(world.size, world.size)
    try:
        values = {}
        for fmt in ("netcdf", "zarr"):
            save = os.path.join(shared, fmt)
            settings = read_inference_settings(base_config(save, {"format": fmt, "metadata": "era5.yaml"}))
            latitude, longitude = grid_coordinates()
            writer = ForecastWriter(settings.output, [OutputVariable(k, lv) for k, lv in LAYOUT], latitude,
                                    longitude, save, steps=1, step_hours=6, manager=manager)
            path = writer.write(tile_of(field("fill", 0, 1, LAYOUT), manager), settings.init_times[0], 1)
            opened = xr.open_dataset(path, engine="netcdf4" if fmt == "netcdf" else "zarr", mask_and_scale=False)
            values[fmt] = {name: (opened[name].attrs.get("units"), opened[name].encoding.get("_FillValue",
                                                                                            opened[name].attrs.get(
                                                                                                "_FillValue")))
                           for name in ("T", "temperature", "SP", "tp")}
            opened.close()
    finally:
        manager.close()
    assert values["netcdf"]["temperature"][0] == "K" and values["zarr"]["temperature"][0] == "K"
    for name in ("T", "temperature", "SP"):
        assert float(values["netcdf"][name][1]) == pytest.approx(9.999e20, rel=1e-6), values
        assert float(values["zarr"][name][1]) == pytest.approx(9.999e20, rel=1e-6), values
    assert np.isnan(float(values["netcdf"]["tp"][1])) and np.isnan(float(values["zarr"]["tp"][1]))


def test_the_schedule_of_files():
    """Names and steps per file as CREDIT cuts them, for each group_by, with and without output_interval; a grouped
    forecast whose last step is not written keeps its last file (CREDIT's writer never flushes it)."""
    init = pd.Timestamp("2020-01-31T12")

    def names(group_by, interval=None, steps=8, fmt="netcdf"):
        output = OutputSettings(format=fmt, group_by=group_by, interval_hours=interval)
        return [(os.path.relpath(f.path, "save"), f.steps) for f in forecast_files(output, "save", init, steps, 6)]

    assert names("step", steps=3) == [("20200131_1200Z/2020-01-31_T1800Z.nc", (1,)),
                                      ("20200131_1200Z/2020-02-01_T0000Z.nc", (2,)),
                                      ("20200131_1200Z/2020-02-01_T0600Z.nc", (3,))]
    assert names("day") == [("20200131_1200Z/2020-01-31.nc", (1,)), ("20200131_1200Z/2020-02-01.nc", (2, 3, 4, 5)),
                            ("20200131_1200Z/2020-02-02.nc", (6, 7, 8))]
    assert names("month", fmt="zarr") == [("20200131_1200Z/2020-01.zarr", (1,)),
                                          ("20200131_1200Z/2020-02.zarr", (2, 3, 4, 5, 6, 7, 8))]
    assert names("year") == [("20200131_1200Z/2020.nc", tuple(range(1, 9)))]
    assert names("full", interval=12) == [("20200131_1200Z/full.nc", (2, 4, 6, 8))]
    assert names("day", interval=12, steps=7) == [("20200131_1200Z/2020-02-01.nc", (2, 4)),
                                                  ("20200131_1200Z/2020-02-02.nc", (6,))]


# -- the inference block --------------------------------------------------------------------------------------

def good_config(**changes):
    conf = base_config("$HOME/forecasts", {"format": "zarr", "group_by": "1D", "output_interval": "12h",
                                            "variables": ["ERA5/prognostic/3d/T",
                                                          {"name": "ERA5/prognostic/3d/temperature", "levels": [850]}],
                                            "metadata": "era5.yaml",
                                            "encoding": {"zlib": True, "T": {"complevel": 9, "_FillValue": -1.0}},
                                            "max_pending": 4})
    conf["inference"].update(changes)
    return conf


def test_inference_settings_as_credit_reads_them():
    settings = read_inference_settings(good_config())
    assert settings.mode == "none" and settings.run_mode == "batch"
    assert settings.save_forecast == os.path.expandvars("$HOME/forecasts")
    assert settings.init_times == (pd.Timestamp("2020-01-01T12"), pd.Timestamp("2020-01-02T12"))
    assert (settings.steps, settings.step_hours, settings.calendar) == (5, 6, "standard")
    out = settings.output
    assert (out.format, out.group_by, out.interval_hours, out.extension) == ("zarr", "day", 12, ".zarr")
    assert out.variables == (("ERA5/prognostic/3d/T", None), ("ERA5/prognostic/3d/temperature", (850,)))
    assert out.netcdf_settings("T", "ERA5/prognostic/3d/T") == {"zlib": True, "complevel": 9, "_FillValue": -1.0}
    assert out.netcdf_settings("SP") == {"zlib": True}
    # inits inclusive, sorted, without repeats; single mode; the blocks inference replaces
    conf = good_config(batch_forecast={"first_init_date": "2020-01-01", "last_init_date": "2020-01-02T06",
                                       "init_interval": "18h", "forecast_length": "1d"})
    settings = read_inference_settings(conf)
    assert settings.init_times == (pd.Timestamp("2020-01-01"), pd.Timestamp("2020-01-01T18")) and settings.steps == 4
    conf = good_config(run_mode="single", single_forecast={"start_datetime": "2021-06-01T00"},
                       data={"source": {}, "timestep": "12h"}, postblocks={"per_step": {}})
    conf["preblocks"] = {"per_step": {"a": 1}}
    settings = read_inference_settings(conf)
    assert settings.init_times == (pd.Timestamp("2021-06-01"),) and settings.steps == 2  # batch's length, 12 h steps
    assert settings.overridden == ("data", "postblocks") and settings.preblocks == {"per_step": {"a": 1}}
    assert settings.training_data["timestep"] == "6h" and settings.data["timestep"] == "12h"
    settings = read_inference_settings(good_config(), init_time="2022-02-02T06", save_dir="/elsewhere")
    assert settings.run_mode == "single" and settings.init_times == (pd.Timestamp("2022-02-02T06"),)
    assert settings.save_forecast == "/elsewhere"


def test_inference_settings_match_credits_helpers():
    """The init times and step counts CREDIT's own helpers compute from the same keys."""
    rollout_utils = mpitest.import_credit("credit.trainers.rollout_utils")
    for batch in ({"first_init_date": "2020-01-01", "last_init_date": "2020-01-03", "init_interval": "12h",
                   "forecast_length": "10d"},
                  {"first_init_date": "2020-02-28T06", "last_init_date": "2020-03-01T07", "init_interval": "1d",
                   "forecast_length": "36h"}):
        conf = good_config(batch_forecast=batch)
        settings = read_inference_settings(conf)
        assert list(settings.init_times) == rollout_utils.batch_init_times(batch)
        assert settings.steps == rollout_utils.parse_length(batch["forecast_length"], "6h")


BAD = [
    (lambda c: c.pop("inference"), "no 'inference' block"),
    (lambda c: c["inference"].pop("mode"), "inference.mode is required"),
    (lambda c: c["inference"].update(mode="tensor"), "inference.mode: 'tensor'"),
    (lambda c: c["inference"].update(run_mode="many"), "inference.run_mode: 'many'"),
    (lambda c: c["inference"].pop("save_forecast"), "inference.save_forecast is required"),
    (lambda c: c["inference"].pop("batch_forecast"), "inference.batch_forecast is required"),
    (lambda c: c["inference"]["batch_forecast"].pop("init_interval"), "batch_forecast.init_interval is required"),
    (lambda c: c["inference"]["batch_forecast"].update(init_interval="0h"), "init_interval: '0h'"),
    (lambda c: c["inference"]["batch_forecast"].update(first_init_date="someday"), "first_init_date: 'someday'"),
    (lambda c: c["inference"]["batch_forecast"].update(last_init_date="2019-01-01"), "is before first_init_date"),
    (lambda c: c["inference"]["batch_forecast"].update(forecast_length="1h"), "forecast_length: '1h'"),
    (lambda c: c["inference"].update(run_mode="single"), "single_forecast.start_datetime is required"),
    (lambda c: c["data"].update(timestep="90min"), "data.timestep: '90min'"),
    (lambda c: c["data"].pop("timestep"), "data.timestep is required"),
    (lambda c: c["data"].update(calendar="noleap"), "data.calendar: 'noleap'"),
    (lambda c: c["inference"]["output"].update(format="grib"), "output.format: 'grib'"),
    (lambda c: c["inference"]["output"].update(group_by="week"), "output.group_by: 'week'"),
    (lambda c: c["inference"]["output"].update(output_interval="30min"), "output_interval: '30min'"),
    (lambda c: c["inference"]["output"].update(output_interval="2d"), "longer than the forecast"),
    (lambda c: c["inference"]["output"].update(variables="ERA5/prognostic/3d/T"), "output.variables"),
    (lambda c: c["inference"]["output"].update(variables=[{"levels": [500]}]), "has no 'name'"),
    (lambda c: c["inference"]["output"].update(variables=["a", "a"]), "is listed twice"),
    (lambda c: c["inference"]["output"].update(encoding={"compression": "zstd"}), "encoding.compression: 'zstd'"),
    (lambda c: c["inference"]["output"].update(encoding={"zlib": "yes"}), "encoding.zlib: 'yes'"),
    (lambda c: c["inference"]["output"].update(encoding={"complevel": 12}), "encoding.complevel: 12"),
    (lambda c: c["inference"]["output"].update(encoding={"dtype": "int16"}), "encoding.dtype: 'int16'"),
    (lambda c: c["inference"]["output"].update(encoding={"T": {"scale_factor": 2}}), "encoding.T.scale_factor: 2"),
    (lambda c: c["inference"]["output"].update(encoding={"contiguous": True, "zlib": True}), "contiguous"),
    (lambda c: c["inference"].update(data=[1]), "inference.data: [1]"),
    (lambda c: c["data"].pop("source"), "data.source is required"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_a_bad_key_or_value_is_one_line_naming_it(change, message):
    conf = good_config()
    change(conf)
    with pytest.raises(UsageError) as raised:
        read_inference_settings(conf)
    text = str(raised.value)
    assert message in text and "\n" not in text, text


# -- mistakes, raised alike on every rank -----------------------------------------------------------------------

def writer_for(save, manager, output=None, layout=LAYOUT, **settings_changes):
    settings = read_inference_settings(base_config(save, output or {"format": "netcdf"}))
    latitude, longitude = grid_coordinates()
    arguments = dict(steps=settings.steps, step_hours=settings.step_hours, manager=manager)
    arguments.update(settings_changes)
    return ForecastWriter(settings.output, [OutputVariable(k, lv) for k, lv in layout], latitude, longitude, save,
                          **arguments)


@pytest.mark.parametrize("output,message", [
    ({"variables": ["ERA5/prognostic/3d/Q"]}, "'ERA5/prognostic/3d/Q' is not a variable the model predicts"),
    ({"variables": [{"name": "ERA5/prognostic/3d/T", "levels": [700]}]}, "has no level 700"),
    ({"variables": [{"name": "ERA5/prognostic/3d/T", "levels": [500]}, "ERA5/prognostic/3d/temperature"]},
     "different levels"),
    ({"encoding": {"Q": {"zlib": True}}}, "encoding.Q: names no variable written"),
    ({"encoding": {"chunksizes": [1, 2, 3]}}, "must have 4 sizes"),
    ({"metadata": "no-such-metadata.yaml"}, "no-such-metadata.yaml"),
])
def test_bad_output_settings_raise_alike_before_any_file(world, shared, output, message):
    manager = DomainParallelManager(world.size, world.size)
    save = os.path.join(shared, "out")
    try:
        with pytest.raises(UsageError, match=re.escape(message)):
            writer_for(save, manager, dict({"format": "netcdf"}, **output))
    finally:
        manager.close()
    assert not os.path.isdir(save) or not os.listdir(save)


def test_a_folder_that_cannot_be_written(world, shared):
    blocker = os.path.join(shared, "a-file")
    if world.rank == 0:
        with open(blocker, "w"):
            pass
    world.Barrier()
    manager = DomainParallelManager(world.size, world.size)
    try:
        with pytest.raises(UsageError, match="inference.save_forecast: .* cannot be written"):
            writer_for(os.path.join(blocker, "forecasts"), manager)
    finally:
        manager.close()


def test_mistakes_in_writes_raise_alike_and_leave_no_whole_looking_file(world, shared):
    """A tile of the wrong shape on one rank, a step out of order, a forecast left unfinished: the same error on
    every rank; files written under their final names are whole, the unfinished one only under .partial."""
    manager = DomainParallelManager(world.size, world.size)
    save = os.path.join(shared, "out")
    init = pd.Timestamp(FIRST_INIT)
    try:
        writer = writer_for(save, manager, {"format": "netcdf", "group_by": "day"})
        whole = tile_of(field("m", 0, 1, LAYOUT), manager)
        wrong = whole[:, :, :-1] if manager.domain_rank == manager.domain_world_size - 1 else whole
        with pytest.raises(ValueError, match="this rank's tile is"):
            writer.write(wrong, init, 1)
        assert writer.write(whole, init, 1) is not None  # 2020-01-01.nc holds step 1 only
        with pytest.raises(ValueError, match="goes in .*2020-01-02.nc after steps \\[2\\]"):
            writer.write(whole, init, 3)
        assert writer.write(whole, init, 2) is None
        with pytest.raises(ValueError, match="does not follow"):
            writer.write(whole, init + pd.Timedelta("1D"), 1)
        with pytest.raises(ValueError, match="is not whole: it has 1 of its steps"):
            writer.finish()
    finally:
        manager.close()
    folder = os.path.join(save, "20200101_1200Z")
    assert sorted(os.listdir(folder)) == ["2020-01-01.nc", "2020-01-02.nc" + PARTIAL]


# -- a killed job, and the writer's memory ------------------------------------------------------------------------

KILL_PROGRAM = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    import pandas as pd
    from mpi4py import MPI
    import mpidomain
    from mpidomain.credit import output
    from mpidomain.credit.inference_settings import read_inference_settings
    from test_credit_outputs import LAYOUT, base_config, field, grid_coordinates, tile_of

    save, fmt, kill_at = sys.argv[1], sys.argv[2], sys.argv[3]
    world = MPI.COMM_WORLD
    manager = mpidomain.initialize_domain_parallel(world.size, world.size)
    settings = read_inference_settings(base_config(save, {"format": fmt, "group_by": "day"}))
    steps = [0]

    def die(where):
        print(f"killed {where}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    real_commit = output._commit
    def commit(partial, final):
        if kill_at == "commit" and "20200102_1200Z" in partial:  # the third file: whole, not renamed
            die(f"before renaming {partial}")
        real_commit(partial, final)
    output._commit = commit
    real_step = output.ForecastWriter._write_netcdf if fmt == "netcdf" else output.ForecastWriter._write_zarr
    def step(self, values, index):
        real_step(self, values, index)
        steps[0] += 1
        if kill_at == "middle" and steps[0] == 7 and manager.domain_rank == 0:  # in the second forecast's 2nd file
            die("in the middle of a file")
    setattr(output.ForecastWriter, "_write_netcdf" if fmt == "netcdf" else "_write_zarr", step)

    latitude, longitude = grid_coordinates()
    writer = output.ForecastWriter(settings.output, [output.OutputVariable(k, lv) for k, lv in LAYOUT], latitude,
                                   longitude, save, steps=settings.steps, step_hours=6, manager=manager)
    for index, init in enumerate(settings.init_times):
        for s in range(1, settings.steps + 1):
            writer.write(tile_of(field("kill", index, s, LAYOUT), manager), init, s)
    print("done", writer.finish(), flush=True)
""")


def check_whole(save, fmt):
    """Every file under its final name holds its steps, each equal to what was written; return the names."""
    settings = read_inference_settings(base_config(save, {"format": fmt, "group_by": "day"}))
    problems, names = [], []
    for index, init in enumerate(settings.init_times):
        for file in forecast_files(settings.output, save, init, settings.steps, 6):
            if not os.path.exists(file.path):
                continue
            names.append(os.path.relpath(file.path, save))
            opened = xr.open_dataset(file.path, engine="netcdf4" if fmt == "netcdf" else "zarr").load()
            if list(opened.time.values) != [np.datetime64(t, "ns") for t in file.valid_times]:
                problems.append(f"{file.path}: times {opened.time.values}")
                continue
            for k, step in enumerate(file.steps):
                values = field("kill", index, step, LAYOUT)
                if not np.array_equal(opened["T"].values[k], values[0:2]) or not np.array_equal(
                        opened["tp"].values[k], values[5]):
                    problems.append(f"{file.path}: step {step} differs")
    return names, problems


@pytest.mark.mpi_job
@pytest.mark.parametrize("fmt", ["netcdf", "zarr"])
@pytest.mark.parametrize("kill_at", ["commit", "middle"])
def test_a_killed_job_leaves_only_whole_files_and_a_rerun_completes_them(world, tmp_path, fmt, kill_at):
    """A 2-rank job SIGKILLed (before a file's rename, or in the middle of a file): every file under its final name
    is whole and right, the one being written is only a .partial; the same job run again writes every file whole
    and leaves no .partial."""
    result = None
    if world.rank == 0:
        program = tmp_path / "kill_job.py"
        program.write_text(KILL_PROGRAM)
        save = str(tmp_path / "save")
        env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), mpitest.REPO])}
        killed = mpitest.run_mpi(2, [str(program), save, fmt, kill_at], timeout=120, env=env)
        before, problems = check_whole(save, fmt)
        leftovers = sorted(os.path.relpath(os.path.join(root, n), save) for root, dirs, files in os.walk(save)
                           for n in dirs + files if n.endswith(PARTIAL))
        rerun = mpitest.run_mpi(2, [str(program), save, fmt, "never"], timeout=120, env=env)
        after, problems_after = check_whole(save, fmt)
        partial_after = [os.path.join(root, n) for root, dirs, files in os.walk(save) for n in dirs + files
                         if n.endswith(PARTIAL)]
        result = dict(killed=(killed.returncode, killed.stdout), before=before, problems=problems,
                      leftovers=leftovers, rerun=(rerun.returncode, rerun.stdout[-300:], rerun.stderr[-2000:]),
                      after=after, problems_after=problems_after, partial_after=partial_after)
    result = mpitest.share(world, result)
    assert result["killed"][0] != 0 and "killed" in result["killed"][1], result["killed"]
    expected_before = 2 if kill_at == "commit" else 3  # files renamed before the kill
    assert len(result["before"]) == expected_before and not result["problems"], result
    assert len(result["leftovers"]) == 1, result["leftovers"]
    assert result["rerun"][0] == 0, result["rerun"]
    assert len(result["after"]) == 4 and not result["problems_after"] and not result["partial_after"], result


MEMORY_PROGRAM = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import pandas as pd
    from mpi4py import MPI
    import mpidomain
    from mpidomain.credit.inference_settings import OutputSettings
    from mpidomain.credit.output import ForecastWriter, OutputVariable, tile_extent

    save, fmt = sys.argv[1], sys.argv[2]
    H, W, L, V = 384, 768, 16, 4
    world = MPI.COMM_WORLD
    manager = mpidomain.initialize_domain_parallel(world.size, world.size)
    rows, columns = tile_extent(manager, (H, W))
    layout = [OutputVariable(f"ERA5/prognostic/3d/v{k}", tuple(range(L))) for k in range(V)]
    i = np.arange(rows.start, rows.stop, dtype=np.float32)[None, :, None]
    j = np.arange(columns.start, columns.stop, dtype=np.float32)[None, None, :]
    c = np.arange(V * L, dtype=np.float32)[:, None, None]
    tile = np.sin(0.01 * i * (c + 1) + 0.02 * j) * (c + 1)  # this rank's tile only, computed in place
    output = OutputSettings(format=fmt, encoding={"zlib": True, "complevel": 1})
    latitude, longitude = np.linspace(90, -90, H), np.arange(W) * 360.0 / W
    last = world.size + 1  # one file per step, the files go round the ranks: each writes one before
    writer = ForecastWriter(output, layout, latitude, longitude, save, steps=last, step_hours=6, manager=manager)
    init = pd.Timestamp("2020-01-01")
    for step in range(1, last):  # the libraries' first use: what they keep counts in the baseline
        writer.write(tile, init, step)

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from the present size
        f.write("5")
    before = status("VmRSS")
    assert status("VmHWM") <= before + (1 << 20)
    writer.write(tile, init, last)
    peak = status("VmHWM")
    writer.finish()
    if fmt == "netcdf":
        import netCDF4
        with netCDF4.Dataset(writer.written[-1]) as ds:
            chunk = int(np.prod(ds["v0"].chunking())) * 4
    else:
        chunk = L * H * W * 4
    records = world.gather((peak - before, tile.nbytes))
    if world.rank == 0:
        print(json.dumps({"growth": [r[0] for r in records], "tile": [r[1] for r in records], "chunk": chunk,
                          "field": V * L * H * W * 4, "writer": 0}))
""")


@pytest.mark.mpi_job
def test_the_netcdf_writer_holds_its_tile_and_one_chunk(world, tmp_path):
    """At 4 ranks (72 MiB field, 18 MiB tiles, 2.25 MiB chunks), the rank writing a file grows by a few chunks of
    one variable while it writes (its tile is already held), far from the field; the other ranks not at all."""
    result = None
    if world.rank == 0:
        program = tmp_path / "memory_job.py"
        program.write_text(MEMORY_PROGRAM)
        # glibc keeps freed memory for reuse and would hide growth: large blocks are mapped and unmapped instead
        job = mpitest.run_mpi(4, [str(program), str(tmp_path / "save"), "netcdf"], timeout=240,
                              env={"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"})
        result = (job.returncode, job.stdout, job.stderr[-3000:])
    result = mpitest.share(world, result)
    assert result[0] == 0, result
    measured = json.loads(result[1].strip().splitlines()[-1])
    writer = measured["growth"][measured["writer"]]
    mib = 1 << 20
    print(f"netCDF writer rank: grew {writer / mib:.1f} MiB writing a {measured['field'] / mib:.0f} MiB field "
          f"(tile {measured['tile'][measured['writer']] / mib:.1f} MiB, chunk {measured['chunk'] / mib:.1f} MiB); "
          f"other ranks {[round(g / mib, 1) for g in measured['growth']]} MiB")
    assert writer <= 4 * measured["chunk"] + 4 * mib, measured  # the chunk's buffer, HDF5's copy and its output
    assert writer < measured["field"] / 4, measured

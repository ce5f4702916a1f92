"""``credit rollout`` on tiles equals CREDIT's own one-process ``credit rollout`` (issue 36).

CREDIT's reference runs once per test session (rank 0, a subprocess, CPU float32, one thread) on the
synthetic CREDIT-layout dataset, from a checkpoint in CREDIT's layout, with the config CREDIT needs to forecast
as intended (``mpidomain.credit.reference.credit_rollout_config``: ``era5_normalizer`` as CREDIT's converter's
``bridgescaler_transform``, ``inference.postblocks`` without the target's twin). Each layout the test's world
allows rolls out in process (1 rank: D=1; 2 ranks: D=2 and two groups of D=1; 4 ranks: D=4, 2 x 2 tiles and
two groups of D=2, the groups splitting the three init times 2 + 1): the files' names, dims, coordinates,
attributes, dtypes, chunks and compression are CREDIT's, their arrays within 1e-5 of CREDIT's (relative to
each variable's largest value), and the scores from tiles equal one process's scores of the same forecasts.
Then: a checkpoint of ``credit train`` rolled out at another layout than it was trained at; bad input, one
error on every rank before any file; and the command line's own jobs (missing packages, a one-rank failure, a
rank killed in the middle of a file and the rerun).
"""

import copy
import csv
import io
import os
import shutil
import time

import numpy as np
import pandas as pd
import pytest
import yaml

from credit_train_support import WORLD, cached, credit_data, on_rank0, shared_folder  # noqa: F401
from mpitest import hiding_env, program_lines, run_mpi, run_python, share

netCDF4 = pytest.importorskip("netCDF4")
xr = pytest.importorskip("xarray")
pytestmark = [pytest.mark.credit]

_ONCE = {}
INITS = ("2000-12-30T00", "2001-01-01T00")  # every day: three forecasts, the last across the year's files
LENGTH = "24h"  # four 6-hour steps
LAYOUTS = {  # name: (domain, world size)
    "D=1": ((1,), 1), "D=2": ((2,), 2), "D=1, 2 groups": ((1,), 2), "D=4": ((4,), 4), "2 x 2 tiles": ((2, 2), 4),
    "D=2, 2 groups": ((2,), 4),
}
METADATA = {"temperature": {"units": "K", "long_name": "temperature"},
            "u_component_of_wind": {"units": "m s-1", "long_name": "eastward wind"},
            "SP": {"units": "Pa", "long_name": "surface pressure"}, "VAR_2T": {"units": "K"},
            "total_precipitation": {"units": "m", "long_name": "total precipitation"},
            "time": {"units": "hours since 1900-01-01", "calendar": "standard"}}


def _write_yaml(path, conf):
    with open(path, "w") as file:
        yaml.safe_dump(conf, file, sort_keys=False)


@pytest.fixture(scope="session")
def rollout_case(credit_data, tmp_path_factory):  # noqa: F811
    """The rollout config (CREDIT's as intended), its checkpoint and CREDIT's own ``credit rollout`` of it, once per
    session: ``{"folder", "conf", "config", "checkpoint", "credit"}``."""
    from mpidomain.credit.reference import credit_checkpoint, credit_rollout_config, run_credit_rollout

    if "case" in _ONCE:
        return _ONCE["case"]
    data_folder, base = credit_data
    folder = shared_folder(tmp_path_factory, "credit-rollout", kept=True)

    def prepare():
        conf = copy.deepcopy(base)
        conf["save_loc"] = os.path.join(folder, "run")
        os.makedirs(conf["save_loc"], exist_ok=True)
        metadata = os.path.join(folder, "metadata.yaml")
        _write_yaml(metadata, METADATA)
        conf["inference"] = {
            "mode": "none", "save_forecast": os.path.join(folder, "credit"),
            "batch_forecast": {"first_init_date": INITS[0], "last_init_date": INITS[1], "init_interval": "1d",
                               "forecast_length": LENGTH},
            "output": {"format": "netcdf", "metadata": metadata}}
        era5 = copy.deepcopy(conf)
        conf = credit_rollout_config(conf, os.path.join(folder, "scalers"))
        config = os.path.join(folder, "rollout.yml")
        _write_yaml(config, conf)
        era5_config = os.path.join(folder, "rollout-era5.yml")
        _write_yaml(era5_config, era5)
        credit_checkpoint(conf, os.path.join(conf["save_loc"], "checkpoint.pt"))  # as after 2 steps
        began = time.perf_counter()
        result = run_credit_rollout(config, timeout=600)
        result["seconds"] = time.perf_counter() - began
        return {"folder": folder, "conf": conf, "config": config, "era5": era5, "era5_config": era5_config,
                "checkpoint": os.path.join(conf["save_loc"], "checkpoint.pt"), "credit": result}

    outcome = on_rank0("preparing the rollout case", lambda: cached(
        "credit-rollout-case", base, prepare, keep=lambda o: o["credit"]["returncode"] == 0))
    if outcome["credit"]["returncode"] != 0:
        pytest.fail(f"CREDIT's credit rollout failed (status {outcome['credit']['returncode']}):\n"
                    f"{outcome['credit']['output'][-3000:]}")
    _ONCE["case"] = outcome
    return outcome


def roll_here(conf, domain, save=None, **options):
    """Roll ``conf`` out in this test's world at ``domain`` into ``save`` (None: the config's save_forecast);
    return the :class:`RolloutSummary`."""
    import torch

    from mpidomain.credit.inference_settings import read_inference_settings
    from mpidomain.credit.rollout import RolloutOptions, rollout
    from mpidomain.manager import initialize_domain_parallel

    settings = read_inference_settings(conf, save_dir=save)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    manager = initialize_domain_parallel(WORLD.size, domain if len(domain) == 2 else domain[0],
                                         (-2, -1) if len(domain) == 2 else -2)
    try:
        return rollout(conf, settings, RolloutOptions(**options), manager, say=lambda line: None)
    finally:
        manager.close()
        torch.set_num_threads(threads)


def fresh(folder):
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    share(WORLD, None)
    return folder


def ours(case, layout):
    """Our rollout of the case at ``layout`` (once per session): (folder, summary)."""
    key = ("ours", layout)
    if key not in _ONCE:
        domain, size = LAYOUTS[layout]
        if WORLD.size != size:
            pytest.skip(f"layout {layout} runs on {size} ranks")
        save = fresh(os.path.join(case["folder"], "ours-" + layout.replace(" ", "").replace(",", "-")))
        _ONCE[key] = save, roll_here(case["conf"], domain, save)
    return _ONCE[key]


def forecast_tree(folder):
    """The init folders' files under ``folder`` (relative paths), and anything else at their level."""
    found = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not name.endswith((".zarr", ".partial")):
            found += [os.path.join(name, f) for f in sorted(os.listdir(path))]
        elif name != "scores.csv":
            found.append(name)
    return found


def nc_summary(path):
    """A netCDF file but its data values: (data model, global attributes, dims, per variable (name, dtype, dims,
    chunking, filters, endianness, attributes))."""
    with netCDF4.Dataset(path) as ds:
        variables = [(name, str(v.dtype), v.dimensions, v.chunking(), v.filters(), v.endian(),
                      [(a, repr(v.getncattr(a))) for a in v.ncattrs()]) for name, v in ds.variables.items()]
        return (ds.data_model, [(a, repr(ds.getncattr(a))) for a in ds.ncattrs()],
                [(n, len(d), d.isunlimited()) for n, d in ds.dimensions.items()], variables)


def nc_values(path):
    with netCDF4.Dataset(path) as ds:
        ds.set_auto_maskandscale(False)
        return {name: np.asarray(v[...]) for name, v in ds.variables.items()}


COORDINATES = ("time", "level", "latitude", "longitude")


def compare_files(ours_folder, credit_folder):
    """(problems, {variable: worst relative difference}) of our forecast files against CREDIT's."""
    problems, worst = [], {}
    names = forecast_tree(ours_folder)
    if names != forecast_tree(credit_folder):
        return [f"files {names}, CREDIT's {forecast_tree(credit_folder)}"], worst
    for name in names:
        mine, theirs = os.path.join(ours_folder, name), os.path.join(credit_folder, name)
        a, b = nc_summary(mine), nc_summary(theirs)
        if a != b:
            problems.append(f"{name}: layout or attributes differ: {a} vs {b}")
        got, want = nc_values(mine), nc_values(theirs)
        for variable, reference in want.items():
            if variable in COORDINATES:
                if not np.array_equal(got[variable], reference):
                    problems.append(f"{name}: coordinate {variable} differs")
                continue
            scale = float(np.abs(reference).max())
            difference = float(np.abs(got[variable].astype(np.float64) - reference).max()) / scale
            worst[variable] = max(worst.get(variable, 0.0), difference)
    return problems, worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forecast_files_equal_credits_rollout(rollout_case, layout):
    """Every file CREDIT's one-process rollout writes, we write: same names, dims, coordinates (bitwise),
    attributes, dtypes, chunks and compression; arrays within 1e-5 of CREDIT's relative to each variable's
    largest value (D=1: bitwise)."""
    save, summary = ours(rollout_case, layout)
    outcome = None
    if WORLD.rank == 0:
        try:
            outcome = compare_files(save, rollout_case["conf"]["inference"]["save_forecast"])
        except Exception as exc:  # noqa: BLE001 - shared: every rank fails
            outcome = ([f"{type(exc).__name__}: {exc}"], {})
    problems, worst = share(WORLD, outcome)
    assert not problems, "\n".join(problems[:10])
    assert worst and max(worst.values()) <= 1e-5, worst
    if LAYOUTS[layout][0] == (1,):
        assert max(worst.values()) == 0.0, worst  # one thread, the same operations: bit for bit
    assert len(summary.table.rows) == 4 * (2 * 4 + 3)  # 4 leads x (2 variables x (3 levels + all) + 3)


@pytest.mark.slow
def test_compiled_and_bf16_rollouts(rollout_case):
    """--compile (aot_eager here: the graph of the library's operators without Inductor's kernels) writes CREDIT's
    files within 1e-5 as eager does, at D = 1 and 2 (D = 4 compiles the same operators, with other extents:
    tests/test_compile.py compiles them at every layout; it would take two minutes of the four-rank pass);
    --amp bf16 writes the same files within 5 % of each variable's largest value (bfloat16 rounds to 2**-8, over
    four steps fed back), at every D."""
    domain = (WORLD.size,)
    problems = {}
    runs = (("compiled", dict(compile=True, compile_backend="aot_eager"), 1e-5),) if WORLD.size <= 2 else ()
    for name, options, bound in runs + (("bf16", dict(amp="bf16"), 0.05),):
        import torch

        torch._dynamo.reset()
        save = fresh(os.path.join(rollout_case["folder"], f"{name}-{WORLD.size}"))
        roll_here(rollout_case["conf"], domain, save, **options)
        torch._dynamo.reset()
        outcome = None
        if WORLD.rank == 0:
            try:
                outcome = compare_files(save, rollout_case["conf"]["inference"]["save_forecast"])
            except Exception as exc:  # noqa: BLE001 - shared: every rank fails
                outcome = ([f"{type(exc).__name__}: {exc}"], {})
        found, worst = share(WORLD, outcome)
        if found or not worst or max(worst.values()) > bound:
            problems[name] = (found[:3], worst)
    assert not problems, problems


def _one_process_scores(case, forecast_folder):
    """The score table of the forecasts in ``forecast_folder`` computed in this process from whole fields: the
    truth read whole from the data files, the climatology the validation period's mean."""
    from mpidomain.credit.output import OutputVariable
    from mpidomain.credit.scores import ClimatologyMean, ForecastScores

    conf = case["conf"]
    source = conf["data"]["source"]["ERA5"]
    variables = [OutputVariable(f"ERA5/prognostic/3d/{n}", tuple(source["levels"])) for n in
                 source["variables"]["prognostic"]["vars_3D"]]
    variables += [OutputVariable(f"ERA5/prognostic/2d/{n}") for n in source["variables"]["prognostic"]["vars_2D"]]
    variables += [OutputVariable(f"ERA5/diagnostic/2d/{n}") for n in source["variables"]["diagnostic"]["vars_2D"]]
    files = sorted(set(source["variables"]["prognostic"]["path"].replace("%Y", y) for y in ("2000", "2001")))
    data = xr.concat([xr.load_dataset(path) for path in files], dim="time")

    def truth(when):
        rows = []
        for variable in variables:
            field = data[variable.name].sel(time=np.datetime64(when, "ns"))
            if variable.levels is not None:
                field = field.sel(level=list(variable.levels), method="nearest")
                rows += list(np.asarray(field.values, dtype=np.float32))
            else:
                rows.append(np.asarray(field.values, dtype=np.float32))
        return np.stack(rows)

    valid = conf["validation_data"]
    period = pd.date_range(valid["start_datetime"], valid["end_datetime"], freq=valid["timestep"])
    mean = ClimatologyMean(variables)
    for when in period:
        mean.add(truth(when))
    latitude, longitude = np.asarray(data.latitude.values), np.asarray(data.longitude.values)
    from mpi4py import MPI

    from mpidomain import DomainParallelManager

    alone = DomainParallelManager(1, 1, comm=MPI.COMM_SELF)  # this process alone, whatever the world
    try:
        return _score_files(ForecastScores(variables, latitude, longitude, alone, climatology=mean.climatology()),
                            forecast_folder, variables, truth)
    finally:
        alone.close()


def _score_files(scores, forecast_folder, variables, truth):
    """Score every file (one step each) under ``forecast_folder``; return the table."""
    for name in forecast_tree(forecast_folder):
        init = pd.Timestamp(pd.to_datetime(os.path.dirname(name), format="%Y%m%d_%H%MZ"))
        with xr.open_dataset(os.path.join(forecast_folder, name)) as step:
            when = pd.Timestamp(step.time.values[0])
            forecast = np.concatenate([np.asarray(step[v.name].values[0]).reshape(v.channels, 48, 64)
                                       for v in variables])
        scores.add(forecast, truth(when), init, int((when - init) / pd.Timedelta("1h")))
    return scores.finish()


def _table(text):
    return [dict(row) for row in csv.DictReader(io.StringIO(text))]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scores_from_tiles_equal_one_process(rollout_case, layout):
    """The scores the rollout computed from tiles (its CSV) equal one process's scores of the same files
    (1e-9 relative: float64 sums in another order) and of CREDIT's files (1e-5: the forecasts' own
    differences); RMSE and ACC by lead time and variable."""
    save, summary = ours(rollout_case, layout)
    outcome = None
    if WORLD.rank == 0:
        try:
            outcome = _compare_scores(rollout_case, save, summary)
        except Exception as exc:  # noqa: BLE001 - shared: every rank fails
            outcome = [f"{type(exc).__name__}: {exc}"]
    problems = share(WORLD, outcome)
    assert not problems, "\n".join(problems[:10])
    assert summary.climatology.startswith("the mean of validation_data's 7 times")


def _compare_scores(rollout_case, save, summary):
    """The differences of the rollout's scores CSV from one process's scores of the same files and CREDIT's."""
    with open(summary.scores_csv) as file:
        written = _table(file.read())
    same = _table(_one_process_scores(rollout_case, save).csv())
    credit = _table(_one_process_scores(rollout_case, rollout_case["conf"]["inference"]["save_forecast"]).csv())
    problems = []
    for label, reference, tolerance in (("the same files", same, 1e-9), ("CREDIT's files", credit, 1e-5)):
        if [(r["lead_hours"], r["variable"], r["level"]) for r in written] != \
                [(r["lead_hours"], r["variable"], r["level"]) for r in reference]:
            problems.append(f"{label}: rows differ")
            continue
        for mine, theirs in zip(written, reference):
            for column, floor in (("rmse", 0.0), ("acc", 1.0)):  # RMSE relative, ACC absolute
                a, b = float(mine[column]), float(theirs[column])
                if not abs(a - b) <= tolerance * max(abs(b), floor):
                    problems.append(f"{label}: {mine['lead_hours']} h {mine['variable']} {mine['level']} "
                                    f"{column}: {a} vs {b}")
    if any(r["forecasts"] != "3" for r in written):
        problems.append("each row averages the 3 forecasts")
    return problems


def test_an_era5_normalizer_config_forecasts_as_credit_intends(rollout_case):
    """The config as trained (``era5_normalizer``, whose inverse CREDIT 2026.2.0 lacks, and the target's twin in
    the postblocks) forecasts the same arrays, bit for bit, as the config CREDIT needs (its converter's
    ``bridgescaler_transform``, no target twin); its ACC climatology is the era5_normalizer's mean file."""
    layout = next(name for name, (_, size) in LAYOUTS.items() if size == WORLD.size) \
        if WORLD.size in (1, 2, 4) else None
    if layout is None:
        pytest.skip("runs on 1, 2 or 4 ranks")
    converted, _ = ours(rollout_case, layout)
    save = fresh(os.path.join(rollout_case["folder"], f"era5-{WORLD.size}"))
    summary = roll_here(rollout_case["era5"], LAYOUTS[layout][0], save)
    outcome = None
    if WORLD.rank == 0:
        names = forecast_tree(save)
        outcome = [] if names == forecast_tree(converted) else [f"files {names}"]
        for name in names:
            a, b = nc_values(os.path.join(save, name)), nc_values(os.path.join(converted, name))
            outcome += [f"{name} {v}" for v in b if not np.array_equal(a[v], b[v])]
    problems = share(WORLD, outcome)
    assert not problems, problems[:10]
    assert summary.climatology.startswith("the era5_normalizer means")


ROLL_AFTER_TRAINING = {1: (1,), 2: (1,), 4: (2, 2)}  # world size: the rollout's layout (training's: D = world size)


def test_a_checkpoint_of_credit_train_forecasts_at_another_layout(rollout_case, tmp_path_factory):
    """``credit train``'s checkpoint.pt, written at D = the world's size (its optimizer, scheduler and ``mpidomain``
    entries beside the weights), rolls out at another layout (D=1, two groups of D=1, 2 x 2 tiles): the same files,
    bit for bit, as a bare ``model_state_dict`` of its weights, and not the case checkpoint's forecasts."""
    import torch

    from credit_train_support import layout_conf, train_here

    if WORLD.size not in ROLL_AFTER_TRAINING:
        pytest.skip("runs on 1, 2 or 4 ranks")
    folder = shared_folder(tmp_path_factory, "rollout-after-training")
    # one optimizer step at the constant learning rate (the config's warmup starts at 0: the weights would stay)
    conf = layout_conf(rollout_case["conf"], os.path.join(folder, "run"), batch=1, batches_per_epoch=1, epochs=1,
                       num_epoch=1, use_ema=False, skip_validation=True, use_scheduler=False)
    train_here(conf, (WORLD.size,))
    trained, bare = os.path.join(conf["save_loc"], "checkpoint.pt"), os.path.join(folder, "bare.pt")
    keys = None
    if WORLD.rank == 0:
        state = torch.load(trained, map_location="cpu", weights_only=True)
        keys = sorted(state)
        torch.save({"model_state_dict": state["model_state_dict"]}, bare)
    keys = share(WORLD, keys)
    assert "mpidomain" in keys and "optimizer_state_dict" in keys, keys
    layout = ROLL_AFTER_TRAINING[WORLD.size]
    runs = [os.path.join(folder, name) for name in ("from-train", "from-bare")]
    for save, checkpoint in zip(runs, (trained, bare)):
        summary = roll_here(conf, layout, save, checkpoint=checkpoint, climatology="none")
        assert summary.checkpoint == checkpoint
    outcome = None
    if WORLD.rank == 0:
        names = forecast_tree(runs[0])
        outcome = [] if names == forecast_tree(runs[1]) and len(names) == 12 else [f"files {names}"]
        changed = False
        for name in names:
            a, b = nc_values(os.path.join(runs[0], name)), nc_values(os.path.join(runs[1], name))
            c = nc_values(os.path.join(rollout_case["conf"]["inference"]["save_forecast"], name))
            outcome += [f"{name} {v}" for v in b if not np.array_equal(a[v], b[v])]
            changed |= any(not np.array_equal(a[v], c[v]) for v in c if v not in COORDINATES)
        if not changed:
            outcome.append("the forecasts equal the case checkpoint's: the trained weights were not used")
    problems = share(WORLD, outcome)
    assert not problems, problems[:10]


# -- bad input: one error on every rank, before any file -------------------------------------------------------------

def _bad_checkpoint(case, folder, change):
    import torch

    path = os.path.join(folder, "bad-checkpoint.pt")
    if WORLD.rank == 0:
        state = torch.load(case["checkpoint"], map_location="cpu", weights_only=True)
        change(state["model_state_dict"])
        torch.save(state, path)
    share(WORLD, None)
    return path


def _rename_one_drop_one(weights):
    keys = list(weights)
    weights["renamed." + keys[0]] = weights.pop(keys[0])
    weights.pop(keys[1])


BAD = {
    "init outside the data": (lambda c: c["inference"]["batch_forecast"].update(first_init_date="1999-12-30T00",
                                                                             last_init_date="1999-12-30T00"),
                              None, "inference.batch_forecast: the forecast from 1999-12-30 00:00 reads prognostic "
                                    "(temperature, u_component_of_wind, SP, VAR_2T) at 1999-12-30 00:00, which no "
                                    "file of"),
    "forcing past the data": (lambda c: c["inference"]["batch_forecast"].update(first_init_date="2001-01-03T06",
                                                                               last_init_date="2001-01-03T06"),
                              None, "reads dynamic_forcing (toa_incident_solar_radiation) at 2001-01-04 00:00, which "),
    "another model's weights": (None, _rename_one_drop_one, "holds another model than the config's model block: 1 "
                                                            "weights the model lacks (e.g. renamed."),
    "another model": (lambda c: c["model"].update(dim=[16, 32, 64, 128]), None, "of other shapes (e.g."),
    "no checkpoint": (lambda c: c.update(save_loc="/nonexistent/run"), None,
                      "checkpoint /nonexistent/run/checkpoint.pt: no such file"),
    "a variable not predicted": (lambda c: c["inference"]["output"].update(variables=["ERA5/prognostic/3d/Q"]), None,
                                 "inference.output.variables: 'ERA5/prognostic/3d/Q' is not a variable the model "
                                 "predicts"),
    "a folder that cannot be written": (lambda c: c["inference"].update(save_forecast=os.path.join(
        c["save_loc"], "checkpoint.pt", "out")), None, "cannot be written"),
    "a climatology that does not fit": (None, None, "read_climatology: "),
}


@pytest.mark.parametrize("case_name", list(BAD))
def test_bad_input_is_one_error_on_every_rank_before_any_file(rollout_case, tmp_path_factory, case_name):
    from mpidomain.command import UsageError

    change, weights, message = BAD[case_name]
    folder = shared_folder(tmp_path_factory, "bad-rollout")
    conf = copy.deepcopy(rollout_case["conf"])
    save = conf["inference"]["save_forecast"] = os.path.join(folder, "out")
    if change is not None:
        change(conf)
    options = {}
    if weights is not None:
        options["checkpoint"] = _bad_checkpoint(rollout_case, folder, weights)
    if case_name == "a climatology that does not fit":  # the statics' file: no temperature there
        options["climatology"] = conf["data"]["source"]["ERA5"]["variables"]["static"]["path"]
    with pytest.raises(UsageError) as raised:
        roll_here(conf, (WORLD.size,) if WORLD.size in (1, 2, 4) else (1,), **options)
    text = str(raised.value)
    assert message in text and "\n" not in text, text
    files = share(WORLD, sorted(os.listdir(save)) if WORLD.rank == 0 and os.path.isdir(save) else [])
    assert not files, files


def test_a_forecast_past_the_data_is_written_and_its_last_step_not_scored(rollout_case, tmp_path_factory):
    """From 2001-01-03T00, four steps: the last valid time (2001-01-04T00) is past the data's end; the forecast is
    written whole, its last lead is not scored (no row), the summary names it."""
    conf = copy.deepcopy(rollout_case["conf"])
    conf["inference"]["batch_forecast"].update(first_init_date="2001-01-03T00", last_init_date="2001-01-03T00")
    save = os.path.join(shared_folder(tmp_path_factory, "past-data"), "out")
    summary = roll_here(conf, (WORLD.size,) if WORLD.size in (1, 2, 4) else (1,), save, climatology="none")
    assert summary.unscored == (pd.Timestamp("2001-01-04T00"),)
    assert sorted({row.lead_hours for row in summary.table.rows}) == [6, 12, 18]
    assert all(np.isnan(row.acc) for row in summary.table.rows)
    files = share(WORLD, forecast_tree(save) if WORLD.rank == 0 else None)
    assert files == ["20010103_0000Z/2001-01-03_T0600Z.nc", "20010103_0000Z/2001-01-03_T1200Z.nc",
                     "20010103_0000Z/2001-01-03_T1800Z.nc", "20010103_0000Z/2001-01-04_T0000Z.nc"], files


# -- the command line's own jobs --------------------------------------------------------------------------------------

COMMAND = ["-m", "mpidomain", "credit", "rollout"]
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rollout_fault_driver.py")


def _job_config(case, name, **inference):
    """The case's config with its own save_forecast (and inference changes), written by rank 0: its path."""
    path = os.path.join(case["folder"], f"{name}.yml")
    if WORLD.rank == 0:
        conf = copy.deepcopy(case["conf"])
        conf["inference"]["save_forecast"] = os.path.join(case["folder"], name)
        for key, value in inference.items():
            if isinstance(value, dict):
                conf["inference"].setdefault(key, {}).update(value)
            else:
                conf["inference"][key] = value
        shutil.rmtree(conf["inference"]["save_forecast"], ignore_errors=True)
        _write_yaml(path, conf)
    return share(WORLD, path)


@pytest.mark.mpi_job
def test_help_lists_the_rollouts_options():
    done = run_python(COMMAND + ["--help"], timeout=120) if WORLD.rank == 0 else None
    status, out = share(WORLD, None if done is None else (done.returncode, done.stdout))
    assert status == 0
    for option in ("-c CONFIG.yml", "--checkpoint PATH", "-D D|DLATxDLON", "--init-time", "--climatology",
                   "--scores CSV", "--compile", "--amp {bf16}", "--rng {tile,one-process}"):
        assert option in out, out


MISSING = [  # (hidden, output format, the package the line names, its install line)
    ("netCDF4", "netcdf", "netCDF4 is needed for", "pip install netCDF4"),
    ("zarr", "zarr", "zarr is needed for writing the Zarr forecast files", "pip install 'zarr>=3.1.5'"),
    ("bridgescaler", "netcdf", "bridgescaler is needed for the normalisation", "pip install bridgescaler"),
    ("yaml", "netcdf", "yaml is needed for reading the config", "pip install pyyaml"),
    ("credit", "netcdf", "credit is needed for CREDIT's model loader", "pip install --no-deps miles-credit"),
]


@pytest.mark.mpi_job
def test_a_missing_package_is_one_line_and_exit_2(rollout_case):
    """With a package hidden, the first from a 2-rank job, the others from one process (the same check, the same
    line): one line from rank 0 naming the package, what needs it and its install line; exit status 2; nothing
    written."""
    configs = {fmt: _job_config(rollout_case, f"missing-{fmt}", output={"format": fmt})
               for fmt in ("netcdf", "zarr")}
    outcomes = None
    if WORLD.rank == 0:
        outcomes = []
        for index, (hidden, fmt, _, _) in enumerate(MISSING):
            began = time.perf_counter()
            env = hiding_env(hide=(hidden,))
            done = (run_mpi(2, COMMAND + ["-c", configs[fmt]], timeout=180, env=env) if index == 0 else
                    run_python(COMMAND + ["-c", configs[fmt]], timeout=180, env=env))
            save = os.path.join(rollout_case["folder"], f"missing-{fmt}")
            outcomes.append((done.returncode, program_lines(done.stderr), time.perf_counter() - began,
                             os.path.isdir(save) and bool(os.listdir(save))))
    outcomes = share(WORLD, outcomes)
    for (hidden, _, needed, install), (status, lines, seconds, written) in zip(MISSING, outcomes):
        print(f"{hidden} hidden: exit {status} after {seconds:.1f} s")
        assert status == 2 and len(lines) == 1, (hidden, lines)
        assert lines[0].startswith("python -m mpidomain credit rollout: error: ") and needed in lines[0] and \
            install in lines[0], lines
        assert not written


@pytest.mark.mpi_job
def test_a_bad_checkpoint_is_one_line_and_exit_2_and_one_ranks_error_ends_the_job(rollout_case, tmp_path_factory):
    """A checkpoint of another model: one line from rank 0, exit 2, no file. A RuntimeError on rank 1 between two
    steps: that rank's line, the job ended at once on every rank (exit 1), never a hang."""
    folder = shared_folder(tmp_path_factory, "rollout-jobs")
    checkpoint = _bad_checkpoint(rollout_case, folder, _rename_one_drop_one)
    bad = _job_config(rollout_case, "bad-checkpoint")
    raising = _job_config(rollout_case, "raising")
    outcome = None
    if WORLD.rank == 0:
        first = run_mpi(2, COMMAND + ["-c", bad, "--checkpoint", checkpoint], timeout=300)
        began = time.perf_counter()
        second = run_mpi(2, [DRIVER, "raise:step:1:2"] + COMMAND[2:] + ["-c", raising], timeout=300)
        outcome = ((first.returncode, program_lines(first.stderr)), (second.returncode, program_lines(second.stderr)),
                   time.perf_counter() - began)
    (status, lines), (raised_status, raised_lines), seconds = share(WORLD, outcome)
    assert status == 2 and len(lines) == 1, lines
    assert "holds another model than the config's model block" in lines[0], lines
    bad_save = os.path.join(rollout_case["folder"], "bad-checkpoint")
    assert not os.path.isdir(bad_save) or not os.listdir(bad_save)
    print(f"one rank's error: the job ended with status {raised_status} after {seconds:.1f} s")
    assert raised_status == 1, raised_lines
    assert any(line.startswith("python -m mpidomain credit rollout: error on rank 1: RuntimeError: injected failure")
               for line in raised_lines), raised_lines


def _files(folder):
    """Every file under ``folder`` (relative paths, sorted)."""
    return sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                  for name in names)


@pytest.mark.mpi_job
@pytest.mark.timeout(900)
def test_a_rank_killed_in_the_middle_of_a_file_leaves_no_whole_looking_file_and_a_rerun_completes(rollout_case):
    """A 4-rank job (D=4, one netCDF file per forecast: group_by full) with rank 1 SIGKILLed after writing the
    second step of the second forecast's file (it writes that file): the first forecast's file is whole (equal to
    the rerun's), the second is only a .partial, the third never started; the same job run again writes every
    file whole, the same bytes, and leaves no .partial."""
    config = _job_config(rollout_case, "killed", output={"group_by": "full"})
    save = os.path.join(rollout_case["folder"], "killed")
    outcome = None
    if WORLD.rank == 0:
        # rank 1's 6th write call: the second forecast's second step (rank 1 writes that forecast's file)
        killed = run_mpi(4, [DRIVER, "kill:write:1:6", *COMMAND[2:], "-c", config, "-D", "4"], timeout=400)
        before = {name: nc_values(os.path.join(save, name)) for name in _files(save) if name.endswith(".nc")}
        partial = [name for name in _files(save) if not name.endswith(".nc")]
        rerun = run_mpi(4, [*COMMAND, "-c", config, "-D", "4"], timeout=400)
        after = {name: nc_values(os.path.join(save, name)) for name in _files(save) if name.endswith(".nc")}
        outcome = dict(killed=(killed.returncode, program_lines(killed.stderr)), before=sorted(before),
                       partial=partial, rerun=(rerun.returncode, program_lines(rerun.stderr)[-5:]),
                       after=_files(save), same=[name for name in before if name in after and all(
                           np.array_equal(before[name][v], after[name][v]) for v in after[name])])
    outcome = share(WORLD, outcome)
    assert outcome["killed"][0] != 0 and any("FAULT write" in line for line in outcome["killed"][1]), \
        outcome["killed"]
    assert outcome["before"] == ["20001230_0000Z/full.nc"], outcome
    assert outcome["partial"] == ["20001231_0000Z/full.nc.partial"], outcome
    assert outcome["same"] == ["20001230_0000Z/full.nc"], outcome
    assert outcome["rerun"][0] == 0, outcome["rerun"]
    assert outcome["after"] == ["20001230_0000Z/full.nc", "20001231_0000Z/full.nc", "20010101_0000Z/full.nc",
                                "scores.csv"], outcome


def _slabs_layout():
    layout = {1: "D=1", 2: "D=2", 4: "D=4"}.get(WORLD.size)
    if layout is None:
        pytest.skip("slabs of 1, 2 or 4 ranks")
    return layout


def test_model_post_conf_tracer_fixer_clamps_every_step_and_global_fixers_are_refused(rollout_case):
    """model.post_conf (the 0.25-degree example's tracer_fixer): CREDIT's rollout cannot build it and ours dropped
    it without a word; now each step's prediction is clamped on every tile by CREDIT's TracerFixer, written
    and fed back so: no value below the threshold in any file, the first step the unfixed forecast clamped
    (bitwise; the other variables unchanged), and a global fixer refused in one line before any file."""
    from mpidomain.command import UsageError

    layout = _slabs_layout()
    baseline, _ = ours(rollout_case, layout)
    first = [name for name in forecast_tree(baseline) if name.endswith(".nc")][0]
    threshold = None
    if WORLD.rank == 0:
        threshold = float(np.median(nc_values(os.path.join(baseline, first))["VAR_2T"]))
    threshold = share(WORLD, threshold)
    conf = copy.deepcopy(rollout_case["conf"])
    conf["model"]["post_conf"] = {"activate": True, "tracer_fixer": {
        "activate": True, "denorm": True, "tracer_name": ["VAR_2T"], "tracer_thres": [threshold]},
        "global_mass_fixer": {"activate": False}}
    save = fresh(os.path.join(rollout_case["folder"], f"tracer-fixer-{WORLD.size}"))
    roll_here(conf, LAYOUTS[layout][0], save)
    problems = []
    if WORLD.rank == 0:
        names = [name for name in forecast_tree(save) if name.endswith(".nc")]
        for name in names:
            if float(nc_values(os.path.join(save, name))["VAR_2T"].min()) < threshold:
                problems.append(f"{name}: VAR_2T below {threshold}")
        got, want = nc_values(os.path.join(save, first)), nc_values(os.path.join(baseline, first))
        if not np.array_equal(got["VAR_2T"], np.maximum(want["VAR_2T"], np.float32(threshold))):
            problems.append(f"{first}: VAR_2T is not the unfixed forecast clamped")
        problems += [f"{first}: {v} changed" for v in want if v != "VAR_2T" and not np.array_equal(got[v], want[v])]
        if not (want["VAR_2T"] < threshold).any():
            problems.append("the threshold clamps nothing: the test tests nothing")
    conf["model"]["post_conf"]["global_mass_fixer"] = {"activate": True}
    refused = fresh(os.path.join(rollout_case["folder"], f"global-fixer-{WORLD.size}"))
    try:
        roll_here(conf, LAYOUTS[layout][0], refused)
        problems.append("a global fixer was not refused")
    except UsageError as error:
        if not str(error).startswith("model.post_conf.global_mass_fixer.activate = True:"):
            problems.append(f"refused with {error}")
    if WORLD.rank == 0 and os.path.isdir(refused) and forecast_tree(refused):
        problems.append(f"files written before the refusal: {forecast_tree(refused)}")
    problems = share(WORLD, problems)
    assert not problems, problems

"""``python -m mpidomain forecast``: the whole job from disk to disk, the same at every layout of the ranks.

In-process runs (:func:`mpidomain.forecast.run_forecast` on the suite's world) compare the layouts this world
allows with each other: at 4 ranks D = 1, 2, 4 and 2 x 2, at 2 ranks D = 1 and 2. A resumed run continues as
the uninterrupted one, also at another D. Two fresh jobs check the command line itself.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
xr = pytest.importorskip("xarray")
pytest.importorskip("zarr")
pytest.importorskip("tqdm")

from mpidomain.command import UsageError  # noqa: E402
from mpidomain.forecast import ForecastSettings, run_forecast  # noqa: E402
from mpitest import run_mpi, share  # noqa: E402

# The U-Net halves the field once: every tile needs an even number of rows and columns.
SMALL = dict(model="cnn", grid=(16, 32), times=12, steps=6, train_rollout=2, rollout=3, batch=4)
FLOAT64 = 1e-10
FLOAT32 = 1e-5


def layouts(world):
    """The -D values this world can run, each with a batch its data-parallel groups divide."""
    found = [1, 2, 4, (2, 2)] if world.size == 4 else [1, 2] if world.size == 2 else [1] if world.size == 1 else []
    if not found:
        pytest.skip(f"the comparison runs at 1, 2 or 4 ranks, not {world.size}")
    return found


def folder(world, tmp_path, name):
    path = share(world, str(tmp_path / name) if world.rank == 0 else None)
    return path


def run(world, tmp_path, name, **changes):
    """Run the job in this process on every rank; return (losses, forecast Dataset loaded)."""
    out = folder(world, tmp_path, name)
    settings = ForecastSettings(**{**SMALL, "out": out, **changes})
    lines = []
    assert run_forecast(settings, out=lines.append) == 0
    losses = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["losses"]
    forecast = None
    if settings.stop_after is None:
        forecast = xr.open_zarr(os.path.join(out, "forecast.zarr"), consolidated=False, chunks=None).load()
    return losses, forecast, lines


def relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def assert_same(got, want, tolerance, what):
    losses, forecast, _ = got
    losses0, forecast0, _ = want
    assert len(losses) == len(losses0)
    assert relative(losses, losses0) <= tolerance, f"{what}: losses {losses} vs {losses0}"
    assert sorted(forecast.data_vars) == sorted(forecast0.data_vars)
    for name in forecast0.data_vars:
        assert forecast[name].dims == forecast0[name].dims and forecast[name].dtype == forecast0[name].dtype
        assert relative(forecast[name].values, forecast0[name].values) <= tolerance, f"{what}: {name}"
    for name in forecast0.coords:
        assert np.array_equal(forecast[name].values, forecast0[name].values), f"{what}: coordinate {name}"


def test_float64_runs_agree_at_every_layout(world, tmp_path, fresh_manager):
    found = layouts(world)
    runs = {d: run(world, tmp_path, f"d{d}", domain=d, dtype="float64") for d in found}
    reference = runs[1]
    losses, forecast, lines = reference
    single = SMALL["steps"] - SMALL["steps"] // 3  # the steps before the rollout fine-tuning
    assert losses[single - 1] < losses[0], f"training did not lower the loss: {losses}"
    assert set(forecast.data_vars) == {"t", "u", "v", "t2m", "sp"}
    assert forecast.sizes["time"] == SMALL["rollout"] and forecast["t"].dims == ("time", "level", "latitude",
                                                                                   "longitude")
    assert np.isfinite(forecast["t"].values).all() and forecast["t"].dtype == np.float64
    if world.rank == 0:
        assert lines[-1].startswith("forecast done: cnn float64 (eager), D=1"), lines[-1]
        assert any("latitude-weighted RMSE" in line for line in lines)
    for d, got in runs.items():
        assert_same(got, reference, FLOAT64, f"D={d}")


def test_float32_runs_agree_across_layouts(world, tmp_path, fresh_manager):
    found = layouts(world)
    first, last = found[0], found[-1]
    assert_same(run(world, tmp_path, "last", domain=last), run(world, tmp_path, "first", domain=first), FLOAT32,
                f"D={last} against D={first}")


def test_resume_at_another_layout_continues_the_run(world, tmp_path, fresh_manager):
    found = layouts(world)
    whole = run(world, tmp_path, "whole", domain=found[-1], dtype="float64")
    half = run(world, tmp_path, "half", domain=found[-1], dtype="float64", stop_after=3)
    assert half[1] is None and len(half[0]) == 3
    checkpoint = os.path.join(folder(world, tmp_path, "half"), "checkpoint.pt")
    resumed = run(world, tmp_path, "resumed", domain=found[0], dtype="float64", resume=checkpoint)
    assert_same(resumed, whole, FLOAT64, f"stopped at D={found[-1]}, resumed at D={found[0]}")


def test_resume_at_the_same_layout_continues_bit_for_bit(world, tmp_path, fresh_manager):
    d = layouts(world)[-1]
    whole = run(world, tmp_path, "whole", domain=d)
    run(world, tmp_path, "again", domain=d, stop_after=2)
    checkpoint = os.path.join(folder(world, tmp_path, "again"), "checkpoint-000002.pt")
    resumed = run(world, tmp_path, "resumed", domain=d, resume=checkpoint)
    assert resumed[0] == whole[0]
    for name in whole[1].data_vars:
        assert np.array_equal(resumed[1][name].values, whole[1][name].values), name


def test_resume_auto_takes_the_newest_complete_checkpoint(world, tmp_path, fresh_manager):
    d = layouts(world)[-1]
    whole = run(world, tmp_path, "whole", domain=d)
    fresh = run(world, tmp_path, "run", domain=d, resume="auto", checkpoint_every=1, stop_after=3)
    out = folder(world, tmp_path, "run")
    lines, files = share(world, (fresh[2], sorted(os.listdir(out))) if world.rank == 0 else None)
    assert any(line.startswith("--resume auto: no complete checkpoint in ") and line.endswith("starting fresh")
               for line in lines), lines
    assert files == ["checkpoint-000001.pt", "checkpoint-000002.pt", "checkpoint-000003.pt", "checkpoint.pt",
                     "era5-synthetic.zarr"]
    if world.rank == 0:
        with open(os.path.join(out, "checkpoint-000004.pt.partial"), "wb") as file:
            file.write(b"a run was killed while writing this")
        with open(os.path.join(out, "checkpoint-000003.pt"), "r+b") as file:
            file.truncate(100)  # corrupt
    resumed = run(world, tmp_path, "run", domain=d, resume="auto")
    lines = share(world, resumed[2] if world.rank == 0 else None)
    assert any("--resume auto skips" in line and "checkpoint-000004.pt.partial: partial" in line for line in lines)
    assert any("--resume auto skips" in line and "checkpoint-000003.pt:" in line for line in lines)
    assert any(line.startswith("--resume auto: continuing from ") and "checkpoint-000002.pt (after step 2)" in line
               for line in lines), lines
    assert resumed[0] == whole[0]
    for name in whole[1].data_vars:
        assert np.array_equal(resumed[1][name].values, whole[1][name].values), name


@pytest.mark.slow  # compiles
def test_the_training_stack_trains_as_eager(world, tmp_path, fresh_manager):
    """--compile with --activation-checkpoint gives the eager run's losses and forecast (float64; compiled with
    aot_eager, the graph the library's operators make, without Inductor's kernels); --amp bf16 trains within
    bfloat16's reach of float32 (a few units of its 2**-8 rounding); the summary line says what was on."""
    d = layouts(world)[-1]
    eager = run(world, tmp_path, "eager", domain=d, dtype="float64")
    stacked = run(world, tmp_path, "stacked", domain=d, dtype="float64", compile=True, activation_checkpoint=True,
                  compile_backend="aot_eager")
    assert_same(stacked, eager, FLOAT64, "compile + activation checkpoint against eager")
    float32 = run(world, tmp_path, "float32", domain=d)
    bf16 = run(world, tmp_path, "bf16", domain=d, amp="bf16")
    assert np.isfinite(bf16[0]).all() and relative(bf16[0], float32[0]) < 0.05, (bf16[0], float32[0])
    if world.rank == 0:
        assert "(compile, activation checkpoint)" in stacked[2][-1], stacked[2][-1]
        assert "(amp bf16)" in bf16[2][-1] and "(eager)" in eager[2][-1], (bf16[2][-1], eager[2][-1])


def nan_store(world, tmp_path, times=12):
    """A small store: t on 2 levels, sp, and an ensemble variable, with a NaN in t@500 at time index 2."""
    path = None
    if world.rank == 0:
        path = str(tmp_path / "nan.zarr")
        rng = np.random.default_rng(0)
        t = rng.standard_normal((times, 2, 16, 32)).astype(np.float32)
        t[2, 0, 3, 4] = np.nan
        xr.Dataset(
            {"t": (("time", "level", "latitude", "longitude"), t),
             "sp": (("time", "latitude", "longitude"), rng.standard_normal((times, 16, 32)).astype(np.float32)),
             "ens": (("time", "member", "latitude", "longitude"), np.zeros((times, 3, 16, 32), np.float32))},
            coords={"time": np.arange(times) * np.timedelta64(6, "h") + np.datetime64("2020-01-01"),
                    "level": [500, 850], "latitude": np.linspace(90, -90, 16), "longitude": np.arange(32) * 11.25},
        ).to_zarr(path, consolidated=False)
    return share(world, path)


def test_a_nan_in_the_data_stops_naming_variable_time_and_step_or_is_skipped(world, tmp_path, fresh_manager):
    data = nan_store(world, tmp_path)
    with pytest.raises(UsageError, match=r"^step \d+: t@500 at time 2020-01-01T12:00:00 \(index 2\) of --data "
                                         r".*nan.zarr is not finite \(NaN or Inf\); clean the data, or pass "
                                         "--skip-nan to skip such steps$"):
        run(world, tmp_path, "stops", data=data, domain=layouts(world)[-1])
    losses, forecast, lines = run(world, tmp_path, "skips", data=data, domain=layouts(world)[-1], skip_nan=True)
    assert sorted(forecast.data_vars) == ["sp", "t"]  # the ensemble variable is not on the grid: not taken
    skipped = [i for i, loss in enumerate(losses) if np.isnan(loss)]
    assert skipped and len(skipped) < len(losses)
    lines = share(world, lines if world.rank == 0 else None)
    assert f"({len(skipped)} skipped: not finite)" in lines[-1]
    assert sum(line.startswith("skipped step ") for line in lines) == len(skipped)
    with pytest.raises(UsageError, match=r"--variables: ens \('time', 'member', 'latitude', 'longitude'\) must have "
                                         "the dims"):
        run(world, tmp_path, "member", data=data, variables=("t", "ens"))


def test_checkpoints_that_do_not_fit_are_refused_before_training(world, tmp_path, fresh_manager):
    run(world, tmp_path, "three", stop_after=3)
    checkpoint = os.path.join(folder(world, tmp_path, "three"), "checkpoint.pt")
    with pytest.raises(UsageError, match=r"--resume .*checkpoint.pt: the checkpoint is after step 3, past --steps 2; "
                                         "raise --steps"):
        run(world, tmp_path, "two", steps=2, resume=checkpoint)
    other = share(world, str(tmp_path / "other.pt") if world.rank == 0 else None)
    if world.rank == 0:
        state = torch.load(checkpoint, weights_only=False)
        state["model"]["extra.weight"] = state["model"].pop("decode.weight")
        torch.save(state, other)
    with pytest.raises(UsageError, match=r"^--resume .*other.pt: the checkpoint holds another model: 1 weights missing "
                                         r"\(e.g. decode.weight\); 1 unexpected \(e.g. extra.weight\); resume with"):
        run(world, tmp_path, "other", resume=other)
    assert not os.path.exists(os.path.join(folder(world, tmp_path, "other"), "checkpoint.pt"))


def test_outputs_are_checked_before_any_work(world, tmp_path, fresh_manager):
    a_file = share(world, str(tmp_path / "a_file") if world.rank == 0 else None)
    if world.rank == 0:
        open(a_file, "w").close()
    world.Barrier()
    with pytest.raises(UsageError, match="^--out .*a_file: a file, not a folder"):
        run_forecast(ForecastSettings(**{**SMALL, "out": a_file}), out=lambda line: None)
    out = folder(world, tmp_path, "plotted")
    with pytest.raises(UsageError, match="^--plot .*missing/forecast.png: the folder .*missing does not exist"):
        run_forecast(ForecastSettings(**{**SMALL, "out": out, "plot": os.path.join(out, "missing", "forecast.png")}),
                     out=lambda line: None)
    assert os.listdir(out) == []  # nothing made: not even the synthetic store


def test_bad_data_and_checkpoint_raise_on_every_rank(world, tmp_path, fresh_manager):
    with pytest.raises(ValueError, match="--data .*no such Zarr store"):
        run_forecast(ForecastSettings(**{**SMALL, "data": folder(world, tmp_path, "missing.zarr"),
                                         "out": folder(world, tmp_path, "x")}), out=lambda line: None)
    with pytest.raises(ValueError, match="--resume .*no such file"):
        run_forecast(ForecastSettings(**{**SMALL, "resume": "/nonexistent/checkpoint.pt",
                                         "out": folder(world, tmp_path, "y")}), out=lambda line: None)
    with pytest.raises(ValueError, match="--rollout must be >= 1"):
        run_forecast(ForecastSettings(**{**SMALL, "rollout": 0}), out=lambda line: None)
    if world.size > 1:
        with pytest.raises(ValueError, match="the forecast's settings must be the same on every rank, but they differ "
                                             "in seed: rank 0: 0, rank 1: 1"):
            run_forecast(ForecastSettings(**{**SMALL, "seed": world.rank}), out=lambda line: None)


@pytest.mark.mpi_job
def test_the_command_runs_and_draws(world, tmp_path):
    result = None
    if world.rank == 0:
        out = tmp_path / "job"
        done = run_mpi(4, ["-m", "mpidomain", "forecast", "--model", "cnn", "--grid", "16x32", "--times", "12",
                           "--steps", "4", "--rollout", "2", "-D", "2x2", "--out", str(out),
                           "--plot", str(out / "forecast.png")], timeout=240)
        png = out / "forecast.png"
        result = (done.returncode, done.stdout, done.stderr, png.exists() and png.stat().st_size > 10000,
                  sorted(os.listdir(out)) if out.exists() else [])
    status, stdout, stderr, drawn, files = share(world, result)
    assert status == 0, stderr[-3000:]
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("forecast done: cnn float32 (eager), D=2x2 x 1 group(s)"), stdout
    assert " MiB/rank" in lines[-1] and "s/step" in lines[-1]
    assert drawn and {"checkpoint.pt", "era5-synthetic.zarr", "forecast.zarr", "forecast.png"} <= set(files)
    assert "train" in stderr and "forecast" in stderr  # the progress bars (rank 0, stderr)
    assert "Exception ignored" not in stderr

"""Latitude-weighted RMSE and ACC from tiles (mpidomain.credit.scores): one process's, and CREDIT's own metrics'.

Every rank scores its tiles of seeded forecasts and truths on every layout of the world's ranks (latitude
slabs, tiles, data-parallel groups splitting the init times); the table must be the one a single process
computes from the whole fields (bit for bit where each rank holds whole rows, to float64 rounding with tiles)
and equal CREDIT 2026.2.0's ``RMSEMetric`` and ``AnomalyCorrelationCoefficientMetric`` (float32) on the
whole fields. Then the climatologies (a mean over a period, a file), the CSV and the mistakes.
"""

import csv
import re
import math
import os

import numpy as np
import pandas as pd
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
pytest.importorskip("yaml")

import mpitest  # noqa: E402
from test_credit_outputs import GRID, grid_coordinates, layouts, shared, tile_of  # noqa: E402,F401

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.credit.output import OutputVariable  # noqa: E402
from mpidomain.credit.scores import ClimatologyMean, ForecastScores, read_climatology  # noqa: E402

VARIABLES = (OutputVariable("ERA5/prognostic/3d/temperature", (500, 850)), OutputVariable("ERA5/prognostic/2d/SP"),
             OutputVariable("ERA5/diagnostic/2d/tp"))
INITS = tuple(pd.Timestamp("2020-01-01") + k * pd.Timedelta("12h") for k in range(3))
LEADS = (6, 12)


def fields(init_index, lead):
    """(forecast, truth), each (C, H, W) float32, the same on every rank."""
    rng = np.random.default_rng((init_index, lead))
    truth = (rng.standard_normal((4,) + GRID) * 5 + 280).astype(np.float32)
    forecast = (truth + rng.standard_normal(truth.shape) * lead / 6 + 0.3).astype(np.float32)
    return forecast, truth


def climatology_field():
    return (np.random.default_rng(99).standard_normal((4,) + GRID) * 2 + 280).astype(np.float32)


def climatology_of(manager):
    whole = tile_of(climatology_field(), manager)
    return {"ERA5/prognostic/3d/temperature": whole[0:2], "SP": whole[2:3], "tp": whole[3]}


def score(manager, climatology=True, csv_path=None):
    """Score every forecast on ``manager``'s layout (the data-parallel groups split the init times)."""
    latitude, longitude = grid_coordinates()
    scores = ForecastScores(VARIABLES, latitude, longitude, manager,
                            climatology=climatology_of(manager) if climatology else None)
    dp_rank, dp_size = manager.data_parallel_coords()
    for index, init in enumerate(INITS):
        if index % dp_size != dp_rank:
            continue
        for lead in LEADS:
            forecast, truth = fields(index, lead)
            scores.add(tile_of(forecast, manager), tile_of(truth[None], manager)[0], init, lead)
    return scores.finish(csv_path)


@pytest.fixture(scope="module")
def alone():
    """A manager of this rank alone: one process's scores, in a job of any size."""
    manager = DomainParallelManager(1, 1, comm=MPI.COMM_SELF)
    yield manager
    manager.close()


def test_scores_from_tiles_equal_one_process(world, layouts, alone):
    reference = score(alone)
    assert len(reference.records) == len(INITS) * len(LEADS) * 5  # temperature 500, 850, all; SP; tp
    assert [(r.lead_hours, r.variable, r.level, r.forecasts) for r in reference.rows][:5] == [
        (6, "temperature", "500", 3), (6, "temperature", "850", 3), (6, "temperature", "all", 3), (6, "SP", "", 3),
        (6, "tp", "", 3)]
    for label, manager in layouts:
        table = score(manager)
        assert [r[:4] for r in table.records] == [r[:4] for r in reference.records], label
        got, want = np.array([r[4:] for r in table.records]), np.array([r[4:] for r in reference.records])
        if manager.tiled:  # a row's sum is its tiles' sums added: float64 rounding
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=0, err_msg=label)
        else:  # whole rows on each rank: the same additions as one process
            assert np.array_equal(got, want), (label, np.abs(got - want).max())
        same = [(r.rmse, r.acc) for r in table.rows] == [(r.rmse, r.acc) for r in reference.rows]
        assert same or manager.tiled, label


def test_without_a_manager_in_one_process(world, alone):
    if world.size != 1:
        pytest.skip("a job of one process scores without a manager")
    latitude, longitude = grid_coordinates()
    scores = ForecastScores(VARIABLES, latitude, longitude, None, climatology=climatology_of(alone))
    forecast, truth = fields(0, 6)
    scores.add(forecast[None], truth[None, :, None], INITS[0], 6)
    with_manager = ForecastScores(VARIABLES, latitude, longitude, alone, climatology=climatology_of(alone))
    with_manager.add(forecast, truth, INITS[0], 6)
    assert scores.finish().records == with_manager.finish().records


@pytest.mark.credit
def test_scores_equal_credits_metrics(world, layouts, shared):
    """The scores from tiles equal CREDIT's own gen2 metrics on the whole fields (float32 there: 2e-6)."""
    torch = pytest.importorskip("torch")
    metrics = mpitest.import_credit("credit.metrics.common")
    anomaly = mpitest.import_credit("credit.metrics.anomaly")
    latitude, _ = grid_coordinates()
    path = os.path.join(shared, "latitude.nc")  # CREDIT reads its latitude weights from a file
    if world.rank == 0:
        xr.Dataset(coords={"latitude": latitude}).to_netcdf(path)
    world.Barrier()
    keys = [(v.key, v.name, slice(k, k + v.channels)) for v, k in zip(VARIABLES, (0, 2, 3))]
    clim = torch.from_numpy(climatology_field())
    expected = []
    for index, init in enumerate(INITS):
        for lead in LEADS:
            forecast, truth = (torch.from_numpy(a) for a in fields(index, lead))
            for key, name, channels in keys:
                levels = range(channels.stop - channels.start) if key.endswith("temperature") else [None]
                for level in list(levels) + (["all"] if key.endswith("temperature") else []):
                    picked = channels if level in (None, "all") else slice(channels.start + level,
                                                                           channels.start + level + 1)
                    state = {"y_processed": {"ERA5": {key: forecast[None, picked, None]}},
                             "y_target_processed": {"ERA5": {key: truth[None, picked, None]}}}
                    common = dict(var_weighting="none", use_latitude_weights=True, latitude_weights=path)
                    rmse = metrics.RMSEMetric("rmse", **common)(state)[f"rmse/{key}"]
                    acc = anomaly.AnomalyCorrelationCoefficientMetric(
                        "acc", climatology={name: clim[picked]}, **common)(state)[f"acc/{key}"]
                    level_label = "" if level is None else level if level == "all" else str(VARIABLES[0].levels[level])
                    expected.append((init, lead, name, level_label, rmse, acc))
    for label, manager in layouts:
        table = score(manager)
        got, want = sorted(table.records), sorted(expected)
        assert [g[:4] for g in got] == [w[:4] for w in want]
        np.testing.assert_allclose([g[4] for g in got], [w[4] for w in want], rtol=2e-6, err_msg=label)
        np.testing.assert_allclose([g[5] for g in got], [w[5] for w in want], rtol=0, atol=2e-6, err_msg=label)


def test_the_climatology_from_the_data_and_from_files(world, layouts, shared):
    latitude, longitude = grid_coordinates()
    truths = [fields(index, 6)[1] for index in range(len(INITS))]
    whole = np.mean(np.stack(truths).astype(np.float64), axis=0)
    grid_file, level_file = os.path.join(shared, "clim.nc"), os.path.join(shared, "mean.nc")
    if world.rank == 0:
        flipped = whole[[1, 0]]  # the file's levels in another order: picked by value
        xr.Dataset({"temperature": (("level", "latitude", "longitude"), flipped),
                    "SP": (("latitude", "longitude"), whole[2]), "tp": (("latitude", "longitude"), whole[3])},
                   coords={"level": [850, 500], "latitude": latitude, "longitude": longitude}).to_netcdf(grid_file)
        xr.Dataset({"temperature": (("level",), [250.0, 270.0, 280.0]), "SP": ((), 1.0e5), "tp": ((), 0.001)},
                   coords={"level": [300, 500, 850]}).to_netcdf(level_file)
    world.Barrier()
    for label, manager in layouts:
        mean = ClimatologyMean(VARIABLES)
        for truth in truths:
            mean.add(tile_of(truth, manager))
        computed = mean.climatology()
        assert np.array_equal(computed["ERA5/prognostic/3d/temperature"], tile_of(whole, manager)[0:2]), label
        read = read_climatology(grid_file, VARIABLES, latitude, longitude, manager)
        for key, first, count in (("ERA5/prognostic/3d/temperature", 0, 2), ("ERA5/prognostic/2d/SP", 2, 1)):
            assert np.array_equal(read[key], tile_of(whole, manager)[first:first + count]), (label, key)
        means = read_climatology(level_file, VARIABLES, latitude, longitude, manager)
        assert means["ERA5/prognostic/3d/temperature"].shape == (2, 1, 1)
        assert means["ERA5/prognostic/3d/temperature"].ravel().tolist() == [270.0, 280.0]
        assert means["ERA5/prognostic/2d/SP"].shape == (1, 1, 1)
        ForecastScores(VARIABLES, latitude, longitude, manager, climatology=means)  # broadcasts: accepted
    with pytest.raises(ValueError, match=re.escape("has no level 700 (it has [300, 500, 850])")):
        read_climatology(level_file, (OutputVariable("ERA5/prognostic/3d/temperature", (500, 700)),), latitude,
                         longitude, layouts[0][1])
    with pytest.raises(ValueError, match="has no variable 'Q'"):
        read_climatology(level_file, (OutputVariable("ERA5/prognostic/3d/Q", (500,)),), latitude, longitude,
                         layouts[0][1])


def _read_rows(path):
    with open(path) as stream:
        return list(csv.DictReader(stream))


def test_the_csv_and_the_text(world, layouts, shared):
    label, manager = layouts[0]
    path = os.path.join(shared, "scores", "scores.csv")
    table = score(manager, csv_path=path)
    # Read on rank 0 and shared: a rank asserting alone before the next collective (score) could leave the others
    # waiting in it.
    rows, partial = mpitest.share(world, (_read_rows(path), os.path.exists(path + ".partial")) if world.rank == 0 else None)
    assert list(rows[0]) == ["lead_hours", "variable", "level", "rmse", "acc", "forecasts"]
    assert len(rows) == len(table.rows) == len(LEADS) * 5
    assert [float(r["rmse"]) for r in rows] == [r.rmse for r in table.rows]
    assert not partial
    text = table.format().splitlines()
    assert text[0].split() == ["lead", "(h)", "variable", "level", "rmse", "acc", "forecasts"]
    assert len(text) == len(table.rows) + 1
    without = score(manager, climatology=False)
    assert all(math.isnan(r.acc) for r in without.rows)
    assert [r.rmse for r in without.rows] == [r.rmse for r in table.rows]
    assert ",," in without.csv().splitlines()[1]  # no ACC: an empty field


def test_mistakes_raise_alike(world, layouts):
    label, manager = layouts[0]
    latitude, longitude = grid_coordinates()
    clim = climatology_of(manager)
    with pytest.raises(ValueError, match="the climatology has no 'ERA5/diagnostic/2d/tp'"):
        ForecastScores(VARIABLES, latitude, longitude, manager,
                       climatology={k: v for k, v in clim.items() if k != "tp"})
    scores = ForecastScores(VARIABLES, latitude, longitude, manager, climatology=clim)
    forecast, truth = (tile_of(a, manager) for a in fields(0, 6))
    wrong = forecast[:, 1:] if manager.domain_rank == 0 else forecast
    with pytest.raises(ValueError, match="this rank's tile is"):
        scores.add(wrong, truth, INITS[0], 6)
    scores.add(forecast, truth, INITS[0], 6)
    with pytest.raises(ValueError, match="was scored already"):
        scores.add(forecast, truth, INITS[0], 6)

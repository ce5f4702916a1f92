"""The parts of ``credit train`` that replace CREDIT's, each against CREDIT's own on the same inputs.

The config reader (every refused key one line), the file index (CREDIT's ``_map_files``/``_find_file``),
the dataset by tile (CREDIT's ``MultiSourceDataset``), the pre/postblocks on tiles (CREDIT's chain with
the scalers its converter writes), the loss and metrics from tiles (CREDIT's ``BaseLoss`` and combined
metric on the whole field), bad data (one error on every rank naming file, variable and time), a NaN in a
sample (stop naming it, or skip), and a resume that continues bit for bit.
"""

import copy
import os
import shutil

import numpy as np
import pytest

from credit_train_support import (WORLD, credit_data, credit_reference, fresh, layout_conf, step_losses,  # noqa: F401
                                  train_here)
from mpitest import share

torch = pytest.importorskip("torch")


def _settings(conf, size=1, domain=None):
    from mpidomain.credit.config import read_settings

    return read_settings(conf, size, domain)


def _refusal(conf, size=1, domain=None):
    from mpidomain.command import UsageError

    with pytest.raises(UsageError) as caught:
        _settings(conf, size, domain)
    return str(caught.value)


def _base_conf():
    from mpidomain.credit.synthetic import synthetic_config

    return synthetic_config("/nowhere")


# -- the config ----------------------------------------------------------------------------------------
def test_config_refuses_what_it_does_not_honour_naming_key_and_value():
    conf = _base_conf()
    conf["trainer"]["parallelism"]["tensor"] = 2
    conf["preblocks"]["ic_only"] = {"regrid": {"type": "regrid"}}
    conf["loss"]["args"]["training_loss"] = "ring-crps"
    message = _refusal(conf)
    assert "\n" not in message
    assert "trainer.parallelism.tensor = 2" in message
    assert "preblocks.ic_only = ['regrid']" in message
    assert "loss.args.training_loss = 'ring-crps'" in message


@pytest.mark.parametrize("change, expected", [
    (lambda c: c["trainer"].update(type="era5-gen1"), "trainer.type = 'era5-gen1'"),
    (lambda c: c["data"]["source"]["ERA5"].update(dataset_type="arco_era5"),
     "data.source.ERA5.dataset_type = 'arco_era5'"),
    (lambda c: c["data"].update(forecast_len=0), "data.forecast_len = 0"),
    (lambda c: c["postblocks"]["per_step"]["reconstruct"]["args"].update(detach=True),
     "postblocks.per_step.reconstruct.args.detach = True"),
    (lambda c: c["postblocks"]["per_step"].pop("reconstruct_target"), "reconstruct_target"),
    (lambda c: c["trainer"].update(grad_max_norm="sometimes"), "trainer.grad_max_norm = 'sometimes'"),
    (lambda c: c["trainer"]["parallelism"].update(data="zero3"), "trainer.parallelism.data = 'zero3'"),
    (lambda c: c["preblocks"]["per_step"].update(log={"type": "log_transform"}),
     "preblocks.per_step.log.type = 'log_transform'"),
    (lambda c: c["loss"].update(type="spectral"), "loss.type = 'spectral'"),
    (lambda c: c["trainer"].update(ensemble_size=0), "trainer.ensemble_size = 0"),
    (lambda c: c["trainer"].update(ensemble_size=4), "data.forecast_len = 2: trainer.ensemble_size 4 trains one step"),
    (lambda c: c.update(loss={"training_loss": "KCRPS"}), "loss.training_loss = 'KCRPS': an ensemble loss needs"),
    (lambda c: c.update(loss={"training_loss": "ring-crps"}), "loss.training_loss = 'ring-crps': ensemble losses"),
    (lambda c: c["trainer"].pop("amp"), "trainer.amp = None"),
])
def test_config_refusal_names_the_key(change, expected):
    conf = _base_conf()
    change(conf)
    assert expected in _refusal(conf)


def test_config_accepts_keys_credit_ignores_and_reads_the_layout():
    conf = _base_conf()
    conf["trainer"].update(mode="ddp", cpu_offload=False, whatever_else=3)
    for block in ("data", "validation_data"):
        conf[block].update(one_shot=True, static_first=True, mean_path="x", lead_time_periods=6)
    conf["pbs"] = {"queue": "main"}
    conf["predict"] = {"mode": "ddp"}
    settings = _settings(conf, 4, (2, 2))
    assert settings.domain == (2, 2) and settings.groups == 4
    assert settings.backprop_on_timestep == (1, 2)
    assert settings.grad_max_norm == "dynamic"
    conf["trainer"]["parallelism"]["domain"] = "2x2"
    assert _settings(conf, 8).domain == (2, 2)
    assert "3 ranks do not split into domain groups of 2" in _refusal(conf, 3, (2,))
    conf["trainer"]["parallelism"]["data"] = "none"
    assert "trainer.parallelism.data = 'none'" in _refusal(conf, 4, (2,))


# -- files ---------------------------------------------------------------------------------------------
@pytest.mark.credit
def test_file_index_equals_credits(credit_data, tmp_path):
    from credit.datasets.gen_2._utils import _extract_time_fmt, _find_file, _map_files, _path_template_to_glob
    import glob
    import pandas as pd

    from mpidomain.credit.files import index_files

    folder, conf = credit_data
    monthly = tmp_path / "month"
    monthly.mkdir()
    for name in ("era5_2001_01.nc", "era5_2001_02.nc", "era5_2001_04.nc"):
        (monthly / name).write_bytes(b"")
    templates = [conf["data"]["source"]["ERA5"]["variables"]["prognostic"]["path"], str(monthly / "era5_%Y_%m.nc"),
                 conf["data"]["source"]["ERA5"]["variables"]["static"]["path"]]
    times = pd.date_range("2000-12-30", "2001-04-30", freq="37h")
    for template in templates:
        theirs = _map_files(sorted(glob.glob(_path_template_to_glob(template))), _extract_time_fmt(template), template)
        ours = index_files(template)
        assert [(a, b, p) for a, b, p in ours.intervals] == [tuple(i) for i in theirs]
        for time in times:
            try:
                expected = _find_file(theirs, time)
            except KeyError:
                with pytest.raises(ValueError, match="no file of"):
                    ours.find(time)
                continue
            assert ours.find(time) == expected
    assert "era5_2001_01.nc" in str(pytest.raises(ValueError, index_files(str(monthly / "era5_%Y_%m.nc")).find,
                                                  "2001-03-02").value)


# -- the dataset by tile -------------------------------------------------------------------------------
def _manager(domain):
    from mpidomain.manager import initialize_domain_parallel

    return initialize_domain_parallel(WORLD.size, domain if len(domain) == 2 else domain[0],
                                      (-2, -1) if len(domain) == 2 else -2)


@pytest.mark.credit
@pytest.mark.parametrize("history_len", [1, 2])
def test_tile_samples_equal_credits(credit_data, history_len):
    from credit.datasets.gen_2.multi_source import MultiSourceDataset

    from mpidomain.credit.dataset import CreditTileDataset, plan_source

    folder, conf = credit_data
    conf = copy.deepcopy(conf)
    conf["data"]["history_len"] = conf["validation_data"]["history_len"] = history_len
    settings = _settings(conf, WORLD.size, (WORLD.size,))
    manager = _manager((WORLD.size,))
    try:
        plan, _ = plan_source(manager.library_comm("world"), (settings.data, settings.valid), manager)
        ours = CreditTileDataset(plan)
        data = dict(copy.deepcopy(conf["data"]), save_loc=None)
        theirs = MultiSourceDataset(data, return_target=True)
        assert list(ours.datetimes) == list(theirs.datetimes)
        rows, columns = slice(*plan.rows), slice(*plan.columns)
        for item in [(ours.datetimes[0].to_datetime64(), 0), (ours.datetimes[5].to_datetime64(), 1),
                     (ours.datetimes[-1].to_datetime64(), 0)]:
            a, b = ours[item], theirs[item]
            for part in ("input", "target"):
                assert list(a[part]["ERA5"]) == list(b[part]["ERA5"])
                for key, value in a[part]["ERA5"].items():
                    assert torch.equal(value, b[part]["ERA5"][key][..., rows, columns]), (part, key)
            assert a["metadata"]["ERA5"]["input_datetime"] == b["metadata"]["ERA5"]["input_datetime"]
        ours.close()
    finally:
        manager.close()


# -- the pre- and postblocks ---------------------------------------------------------------------------
@pytest.mark.credit
def test_blocks_equal_credits_chain_with_its_converted_scalers(credit_data, tmp_path):
    from credit.datasets.gen_2.channel_utils import ChannelSchema
    from credit.postblock import apply_postblocks, build_postblocks
    from credit.preblock import apply_preblocks, attach_channel_schema, build_preblocks
    from torch.utils.data import default_collate

    from mpidomain.credit.blocks import Blocks
    from mpidomain.credit.dataset import CreditTileDataset, plan_source
    from mpidomain.credit.reference import credit_config

    folder, conf = credit_data
    settings = _settings(conf)
    plan, _ = plan_source(_self(), (settings.data, settings.valid), None)
    dataset = CreditTileDataset(plan)
    batch = default_collate([dataset[(t.to_datetime64(), 0)] for t in dataset.datetimes[[1, 7]]])
    ours = Blocks(conf, settings)
    x, y = ours.pre(batch["input"]["ERA5"], batch["target"]["ERA5"])
    theirs_conf = credit_config(conf, str(tmp_path))
    schema = ChannelSchema.from_config(theirs_conf)
    pre = build_preblocks(theirs_conf, "per_step")
    attach_channel_schema(pre, schema)
    out = apply_preblocks(pre, batch)
    assert torch.equal(x, out["x"]) and torch.equal(y, out["y"].flatten(1, 2))
    y_pred = torch.randn_like(y)
    state = ours.post({"y_pred": y_pred, "y": y})
    post = build_postblocks(theirs_conf, "per_step")
    credit_state = apply_postblocks(post, {"y_pred": y_pred, "y": out["y"], "metadata": out["metadata"]})
    for key in ("y_processed", "y_target_processed"):
        for name, value in credit_state[key]["ERA5"].items():
            assert torch.equal(state[key][name], value), (key, name)


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


@pytest.mark.credit
def test_era5_normalizer_scalers_equal_credits_converter(credit_data, tmp_path):
    from bridgescaler import load_scaler_dict
    from credit.cli._convert import _build_bridgescaler_jsons

    from mpidomain.credit.blocks import channel_layouts, era5_scalers

    folder, conf = credit_data
    args = conf["preblocks"]["per_step"]["norm"]["args"]
    source = conf["data"]["source"]["ERA5"]["variables"]
    groups = {(kind, dim): group[key] for kind, group in source.items() for dim, key in (("3d", "vars_3D"),
                                                                                          ("2d", "vars_2D"))
              if group.get(key)}
    _build_bridgescaler_jsons(args["mean_path"], args["std_path"], groups, str(tmp_path / "pre.json"),
                              str(tmp_path / "post.json"))
    theirs = load_scaler_dict(str(tmp_path / "pre.json"))["input"]["ERA5"]
    inputs, targets = channel_layouts(conf)
    ours = era5_scalers(args["mean_path"], args["std_path"], [k for k, _, _ in inputs + targets])
    assert set(ours) == set(theirs)
    for key, scaler in ours.items():
        assert torch.equal(scaler.mean_x_, theirs[key].mean_x_) and torch.equal(scaler.var_x_, theirs[key].var_x_)


# -- the loss and metrics from tiles -------------------------------------------------------------------
@pytest.mark.credit
@pytest.mark.parametrize("domain", ["slabs", "tiles"])
def test_loss_and_metrics_from_tiles_equal_credits_on_the_whole_field(credit_data, domain):
    from credit.datasets.gen_2.channel_utils import ChannelSchema
    from credit.losses import load_loss
    from credit.metrics import load_metric

    from mpidomain.credit.output import tile_extent
    from mpidomain.credit.loss import TileLoss, TileMetrics

    if domain == "tiles" and WORLD.size != 4:
        pytest.skip("2 x 2 tiles on 4 ranks")
    layout = (2, 2) if domain == "tiles" else (WORLD.size,)
    folder, conf = credit_data
    schema = ChannelSchema.from_config(conf)
    generator = torch.Generator().manual_seed(3)
    full_pred, full_target = {}, {}
    for entry in schema.target_layout:
        shape = (2, entry["n_levels"], 1, 48, 64)
        full_target[entry["var_key"]] = 100 * torch.randn(shape, generator=generator, dtype=torch.float64).float()
        full_pred[entry["var_key"]] = full_target[entry["var_key"]] + torch.randn(shape, generator=generator)
    manager = _manager(layout)
    try:
        rows, columns = ((r.start, r.stop) for r in tile_extent(manager, (48, 64)))
        cut = lambda t: t[..., rows[0]:rows[1], columns[0]:columns[1]].clone()  # noqa: E731
        pred = {k: cut(v).requires_grad_() for k, v in full_pred.items()}
        target = {k: cut(v) for k, v in full_target.items()}
        ours = TileLoss(conf, manager, rows, 48)
        loss = ours({"y_processed": pred, "y_target_processed": target})
        loss.backward()
        whole = {k: v.clone().requires_grad_() for k, v in full_pred.items()}
        reference = load_loss(conf)({"y_processed": {"ERA5": whole}, "y_target_processed": {"ERA5": full_target}})
        reference.backward()
        assert abs(loss.item() - reference.item()) <= 1e-6 * abs(reference.item())
        for key, value in pred.items():
            expected = cut(whole[key].grad)
            assert torch.allclose(value.grad, expected, rtol=1e-5, atol=1e-6 * expected.abs().max()), key
        metrics = TileMetrics(conf, manager, rows)({"y_processed": pred, "y_target_processed": target})
        expected = load_metric(conf)({"y_processed": {"ERA5": full_pred}, "y_target_processed": {"ERA5": full_target}})
        assert list(metrics) == list(expected)
        for name, value in expected.items():
            assert abs(metrics[name] - value) <= 1e-5 * max(abs(value), 1e-3), name
    finally:
        manager.close()


FLAT_LOSSES = {  # name: (loss block, batch, members)
    "mse with spectral and power terms": ({"training_loss": "mse", "use_latitude_weights": True,
                                           "use_variable_weights": False, "use_spectral_loss": True,
                                           "use_power_loss": True, "spectral_lambda_reg": 0.1,
                                           "spectral_wavenum_init": 3}, 2, 1),
    "KCRPS": ({"training_loss": "KCRPS", "use_latitude_weights": False, "use_variable_weights": False}, 2, 2),
    "almost-fair-crps, latitude weights and a spectral term": (
        {"training_loss": "almost-fair-crps", "use_latitude_weights": True, "use_variable_weights": False,
         "use_spectral_loss": True, "spectral_lambda_reg": 0.5, "spectral_wavenum_init": 0}, 1, 3),
}


@pytest.mark.credit
@pytest.mark.parametrize("domain", ["slabs", "tiles"])
@pytest.mark.parametrize("name", list(FLAT_LOSSES))
def test_flat_losses_from_tiles_equal_credits_on_the_whole_field(credit_data, domain, name):
    """The flat form's VariableTotalLoss2D with its spectral and power terms (whole rows: on tiles through a move
    within each band) and the ensemble CRPS losses (members along the batch axis), loss and gradients, against
    CREDIT's criterion on the whole field in one process."""
    from credit.losses import load_loss

    from mpidomain.credit.loss import TileLoss
    from mpidomain.credit.model import training_conf
    from mpidomain.credit.output import tile_extent

    if domain == "tiles" and WORLD.size != 4:
        pytest.skip("2 x 2 tiles on 4 ranks")
    layout = (2, 2) if domain == "tiles" else (WORLD.size,)
    folder, conf = credit_data
    block, batch, members = FLAT_LOSSES[name]
    conf = dict(conf, loss=dict(block, latitude_weights=conf["loss"]["args"]["latitude_weights"]),
                trainer=dict(conf["trainer"], ensemble_size=members))
    conf, _ = training_conf(conf)
    channels = len(load_loss(conf).vars) if block["use_latitude_weights"] else 9
    generator = torch.Generator().manual_seed(5)
    full_target = torch.randn((batch, channels, 48, 64), generator=generator)
    full_pred = (torch.repeat_interleave(full_target, members, 0)
                 + 0.3 * torch.randn((batch * members, channels, 48, 64), generator=generator))
    manager = _manager(layout)
    try:
        rows, columns = ((r.start, r.stop) for r in tile_extent(manager, (48, 64)))
        cut = lambda t: t[..., rows[0]:rows[1], columns[0]:columns[1]].clone()  # noqa: E731
        pred = cut(full_pred).requires_grad_()
        loss = TileLoss(conf, manager, rows, 48)({"y": cut(full_target), "y_pred": pred})
        loss.backward()
        whole = full_pred.clone().requires_grad_()
        reference = load_loss(conf)(full_target, whole).mean()
        reference.backward()
        verdict = abs(loss.item() - reference.item()) <= 1e-5 * abs(reference.item())
        expected = cut(whole.grad)
        verdict = verdict and torch.allclose(pred.grad, expected, rtol=1e-4, atol=1e-5 * expected.abs().max())
        assert all(WORLD.allgather(bool(verdict))), f"{loss.item()} vs CREDIT's {reference.item()}"
    finally:
        manager.close()


def xr_open(path):
    import xarray as xr

    return xr.open_dataset(path)


@pytest.mark.credit
def test_the_flat_loss_form_trains_with_credits_flat_variable_keys(credit_data):
    """The flat loss form (``training_loss: mse``: CREDIT's VariableTotalLoss2D) reads ``data.variables``, which
    CREDIT's train_gen2 injects (``inject_flat_var_keys``) before its loss: credit train does the same (it
    failed with a bare KeyError 'variables')."""
    from mpidomain.credit.model import training_conf

    folder, conf = credit_data
    flat = layout_conf(conf, fresh(os.path.join(folder, f"flat-loss-{WORLD.size}")), batches_per_epoch=2, epochs=1,
                       skip_validation=True)
    flat["loss"] = {"training_loss": "mse", "validation_loss": "mse", "use_variable_weights": False,
                    "use_latitude_weights": False, "use_spectral_loss": False, "use_power_loss": False}
    prepared, _ = training_conf(flat)
    assert prepared["data"]["variables"] == flat["data"]["source"]["ERA5"]["variables"]["prognostic"]["vars_3D"]
    assert "variables" not in flat["data"], "training_conf changed the config it was given"
    train_here(flat, (WORLD.size,))
    _, rows = step_losses(flat["save_loc"])
    assert len(rows) == 2 and all(np.isfinite(v) for row in rows for v in row[1:]), rows


@pytest.mark.credit
def test_a_scaler_written_for_other_levels_is_one_line_naming_file_and_variable(credit_data, tmp_path):
    """bridgescaler asserted "Number of input variables does not match scaler." mid-step, naming neither the
    file nor the variable: the blocks refuse such a scaler when they are built, naming both."""
    from mpidomain.command import UsageError
    from mpidomain.credit.blocks import Blocks
    from mpidomain.credit.reference import credit_config

    folder, conf = credit_data
    scaled = credit_config(conf, str(tmp_path))  # bridgescaler JSONs for the config's levels
    levels = scaled["data"]["source"]["ERA5"]["levels"]
    scaled["data"]["source"]["ERA5"]["levels"] = levels[:-1]
    scaled["model"]["levels"] = len(levels) - 1
    with pytest.raises(UsageError) as caught:
        Blocks(scaled, _settings(scaled))
    message = str(caught.value)
    assert "preblocks.per_step." in message and "_pre_scaler.json" in message, message
    assert f"holds {len(levels)} channel(s), the data has {len(levels) - 1} level(s)" in message, message


# -- bad data: one error on every rank -----------------------------------------------------------------
def _copy_data(folder, tmp_path_factory):
    from credit_train_support import shared_folder

    target = shared_folder(tmp_path_factory, "credit-bad")
    if WORLD.rank == 0:
        shutil.rmtree(target)
        # the dataset's files only, not the runs other tests keep beside them
        shutil.copytree(folder, target, ignore=lambda where, names: [
            n for n in names if where == folder and os.path.isdir(os.path.join(where, n)) and n != "data"])
    share(WORLD, None)
    return target


def _retarget(conf, old, new):
    import json

    return json.loads(json.dumps(conf).replace(old, new))


def _edit(path, change):
    """Rewrite the netCDF file at ``path`` with ``change(dataset)`` applied (rank 0), then go on."""
    import xarray as xr

    if WORLD.rank == 0:
        with xr.open_dataset(path) as ds:
            edited = change(ds.load())
        os.remove(path)
        edited.to_netcdf(path)
    share(WORLD, None)


def _plan_error(conf):
    from mpidomain.command import UsageError
    from mpidomain.credit.dataset import plan_source

    settings = _settings(conf, WORLD.size, (WORLD.size,))
    manager = _manager((WORLD.size,))
    try:
        with pytest.raises(UsageError) as caught:
            plan_source(manager.library_comm("world"), (settings.data, settings.valid), manager, (48, 64))
    finally:
        manager.close()
    messages = WORLD.allgather(str(caught.value))
    assert len(set(messages)) == 1, messages
    return messages[0]


@pytest.mark.credit
@pytest.mark.parametrize("problem", ["year missing", "variable absent", "variable renamed", "level not found",
                                     "grid differs", "time absent"])
def test_bad_data_is_one_error_on_every_rank_naming_file_variable_and_time(problem, credit_data, tmp_path_factory):
    folder, conf = credit_data
    copy_folder = _copy_data(folder, tmp_path_factory)
    conf = _retarget(conf, folder, copy_folder)
    year2001 = os.path.join(copy_folder, "data", "era5_synthetic_2001.nc")
    if problem == "year missing":  # the date range reaches 2002, whose file is not there
        conf["data"]["end_datetime"] = "2002-01-01T12:00:00"
        message = _plan_error(conf)
        assert "era5_synthetic_%Y.nc holds 2002-01-01" in message and "prognostic" in message
    elif problem == "variable absent":
        _edit(year2001, lambda ds: ds.drop_vars("VAR_2T"))
        message = _plan_error(conf)
        assert "era5_synthetic_2001.nc: variable VAR_2T (prognostic) is absent" in message
        with xr_open(year2001) as ds:  # every name the file has, not the first dozen
            assert all(str(name) in message for name in ds.data_vars), message
    elif problem == "variable renamed":  # the name the user is looking for comes first, however long the list
        _edit(year2001, lambda ds: ds.rename({"VAR_2T": "var_2t"}))
        message = _plan_error(conf)
        assert "variable VAR_2T (prognostic) is absent; closest: var_2t" in message, message
    elif problem == "level not found":
        conf["data"]["source"]["ERA5"]["levels"] = [300.0, 500.0, 1000.0]
        message = _plan_error(conf)
        assert "variable temperature: level 1000 is not found" in message and "era5_synthetic_2000.nc" in message
    elif problem == "grid differs":
        _edit(year2001, lambda ds: ds.assign_coords(latitude=ds.latitude.values + 0.5))
        message = _plan_error(conf)
        assert "era5_synthetic_2001.nc: its grid" in message and "differs" in message
    else:
        _edit(year2001, lambda ds: ds.isel(time=[t for t in range(ds.sizes["time"]) if t != 3]))
        message = _plan_error(conf)
        assert "era5_synthetic_2001.nc: time 2001-01-01 18:00:00" in message and "absent" in message


@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_nan_in_a_sample_stops_naming_it_or_is_skipped(credit_data, tmp_path_factory):
    from mpidomain.command import UsageError
    from mpidomain.credit.trainer import TrainOptions

    folder, conf = credit_data
    copy_folder = _copy_data(folder, tmp_path_factory)
    conf = _retarget(conf, folder, copy_folder)
    def poison(ds):
        values = ds["SP"].values.copy()
        values[:, 5, 7] = np.nan  # every time of one grid point (in the first latitude rank's rows)
        return ds.assign(SP=(ds["SP"].dims, values))
    for year in (2000, 2001):
        _edit(os.path.join(copy_folder, "data", f"era5_synthetic_{year}.nc"), poison)
    conf = layout_conf(conf, fresh(os.path.join(copy_folder, "nan-run")), batches_per_epoch=2, epochs=1,
                       num_epoch=1, skip_validation=True)
    with pytest.raises(UsageError) as caught:
        train_here(conf, (WORLD.size,))
    messages = WORLD.allgather(str(caught.value))
    assert len(set(messages)) == 1
    assert messages[0].startswith("step 1: ERA5/prognostic/2d/SP at 200") and "era5_synthetic_200" in messages[0]
    assert "not finite" in messages[0] and "skip_nan_prune" in messages[0]
    conf = layout_conf(conf, fresh(os.path.join(copy_folder, "nan-skip")))
    summary = train_here(conf, (WORLD.size,), TrainOptions(progress=False, skip_nan=True))
    assert summary["run"].skipped == [1, 2] and summary["run"].step == 2


# -- resuming ------------------------------------------------------------------------------------------
@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_credits_load_weights_keys_continue_its_run(credit_data, credit_reference):
    """load_weights, load_optimizer, load_scheduler, reload_epoch in save_loc: the next epoch, its log kept."""
    folder, conf = credit_data
    save_loc = fresh(os.path.join(folder, f"load-weights-{WORLD.size}"))
    if WORLD.rank == 0:
        os.makedirs(save_loc)
        for name in ("checkpoint.pt", "checkpoint_ema.pt", "training_log.csv"):
            shutil.copyfile(os.path.join(credit_reference["save_loc"], name), os.path.join(save_loc, name))
    share(WORLD, None)
    conf = layout_conf(conf, save_loc, epochs=3, num_epoch=3, load_weights=True, load_optimizer=True,
                       load_scheduler=True, load_scaler=True, reload_epoch=True)
    run = train_here(conf, (WORLD.size,))["run"]
    assert run.history["epoch"] == [0, 1, 2] and run.step == 15
    import pandas as pd

    log = pd.read_csv(os.path.join(save_loc, "training_log.csv"))
    assert list(log["epoch"]) == [0, 1, 2]
    reference = pd.read_csv(os.path.join(credit_reference["save_loc"], "training_log.csv"))
    assert np.allclose(log["train_loss"][:2], reference["train_loss"], rtol=1e-12)



@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_stop_and_resume_continue_bit_for_bit(credit_data):
    """Stopped after step 5 (the end of epoch 0, before its validation) and resumed: the same run."""
    from mpidomain.credit.trainer import TrainOptions

    folder, conf = credit_data
    whole = fresh(os.path.join(folder, f"resume-whole-{WORLD.size}"))
    train_here(layout_conf(conf, whole), (WORLD.size,))
    parts = fresh(os.path.join(folder, f"resume-parts-{WORLD.size}"))
    stopped = train_here(layout_conf(conf, parts), (WORLD.size,),
                         TrainOptions(progress=False, stop_after=5, checkpoint_every=3))
    assert stopped["stopped"] == "--stop-after 5" and stopped["run"].step == 5
    resumed = train_here(layout_conf(conf, parts), (WORLD.size,), TrainOptions(progress=False, resume="auto"))
    assert resumed["run"].step == 10
    assert step_losses(parts) == step_losses(whole)
    a = torch.load(os.path.join(parts, "checkpoint.pt"), weights_only=True)
    b = torch.load(os.path.join(whole, "checkpoint.pt"), weights_only=True)
    assert all(torch.equal(a["model_state_dict"][k], v) for k, v in b["model_state_dict"].items())
    assert a["optimizer_state_dict"]["state"].keys() == b["optimizer_state_dict"]["state"].keys()
    for index, state in b["optimizer_state_dict"]["state"].items():
        assert all(torch.equal(a["optimizer_state_dict"]["state"][index][k], v) for k, v in state.items())
    assert a["scheduler_state_dict"] == b["scheduler_state_dict"]
    with open(os.path.join(parts, "training_log.csv")) as x, open(os.path.join(whole, "training_log.csv")) as y:
        assert x.read() == y.read()
    if WORLD.size == 4:  # the same checkpoint continued on 2 x 2 tiles: the same run to the reduction order
        tiles = fresh(os.path.join(folder, "resume-tiles"))
        if WORLD.rank == 0:
            shutil.copytree(parts, tiles, dirs_exist_ok=True)
            for name in os.listdir(tiles):
                if name not in ("checkpoint-step-000005.pt",):
                    os.remove(os.path.join(tiles, name))
        share(WORLD, None)
        train_here(layout_conf(conf, tiles), (2, 2), TrainOptions(progress=False, resume="auto"))
        _, rows = step_losses(tiles)
        _, expected = step_losses(whole)
        assert [r[0] for r in rows] == list(range(6, 11))
        for row, reference in zip(rows, expected[5:]):
            assert abs(row[1] - reference[1]) <= 1e-5 * abs(reference[1])


@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_amp_bf16_trains_within_bfloat16s_reach(credit_data):
    """--amp bf16 (autocast to bfloat16 on the CPU, where CREDIT's trainer.amp does nothing): every step's loss
    within 5 % of the float32 run's (bfloat16 rounds to 2**-8 relative; ten steps of AdamW carry it on), finite,
    and the run says what was on."""
    from mpidomain.credit.trainer import TrainOptions

    folder, conf = credit_data
    plain = fresh(os.path.join(folder, f"amp-plain-{WORLD.size}"))
    eager = train_here(layout_conf(conf, plain), (WORLD.size,))
    half = fresh(os.path.join(folder, f"amp-bf16-{WORLD.size}"))
    bf16 = train_here(layout_conf(conf, half), (WORLD.size,), TrainOptions(progress=False, amp="bf16"))
    assert (eager["run"].stack.summary(), bf16["run"].stack.summary()) == ("eager", "amp bf16")
    (_, got), (_, want) = step_losses(half), step_losses(plain)
    assert len(got) == len(want) and all(np.isfinite(row[1]) for row in got)
    worst = max(abs(g[1] - w[1]) / abs(w[1]) for g, w in zip(got, want))
    assert worst < 0.05, (worst, got, want)


@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resume_from_credits_own_checkpoint(credit_data, credit_reference):
    """CREDIT's checkpoint.pt (after epoch 1) continues at epoch 2 with its weights, optimizer and scheduler."""
    from mpidomain.credit.trainer import TrainOptions

    folder, conf = credit_data
    save_loc = fresh(os.path.join(folder, f"from-credit-{WORLD.size}"))
    credit_checkpoint = os.path.join(credit_reference["save_loc"], "checkpoint.pt")
    theirs = torch.load(credit_checkpoint, weights_only=False)
    summary = train_here(layout_conf(conf, save_loc, epochs=3, num_epoch=3), (WORLD.size,),
                         TrainOptions(progress=False, resume=credit_checkpoint))
    run = summary["run"]
    assert run.history["epoch"] == [2] and run.step == 15
    ours = torch.load(os.path.join(save_loc, "checkpoint.pt"), weights_only=True)
    assert ours["epoch"] == 2
    assert ours["scheduler_state_dict"]["last_epoch"] == theirs["scheduler_state_dict"]["last_epoch"] + 5
    _, rows = step_losses(save_loc)
    assert [row[0] for row in rows] == [11, 12, 13, 14, 15]


@pytest.mark.credit
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dataloader_workers_read_the_same_samples_without_mpi(credit_data, credit_reference):
    """thread_workers: 1 (a spawned worker per rank, which never starts MPI) trains the same steps as none."""
    folder, conf = credit_data
    save_loc = fresh(os.path.join(folder, f"workers-{WORLD.size}"))
    conf = layout_conf(conf, save_loc, thread_workers=1, valid_thread_workers=1, prefetch_factor=2, epochs=1,
                       num_epoch=1)
    summary = train_here(conf, (WORLD.size,))
    assert summary["run"].step == 5
    _, rows = step_losses(save_loc)
    for row, reference in zip(rows, credit_reference["steps"]):
        assert abs(row[1] - sum(reference)) <= 1e-5 * abs(sum(reference))

"""A tiny CREDIT-layout dataset and gen2 config made on the spot: :func:`write_synthetic_credit`.

What a CREDIT user has on disk, small: yearly netCDF files named by ``%Y`` with CREDIT's variable and
coordinate names (``time``, ``level``, ``latitude`` north to south, ``longitude``), a static file,
per-variable mean and standard deviation files, a bridgescaler JSON (the loss's inverse-variance
weights read it) and a gen2 config that trains a slim CrossFormer on them. The times straddle a year
boundary, so a sample's rollout reads two files. Values are smooth waves on realistic means plus
seeded noise, float32; the same seed gives the same files.
"""

import os

import numpy as np

__all__ = ["SYNTHETIC_LEVELS", "SYNTHETIC_VARIABLES", "write_synthetic_credit", "synthetic_config"]

#: Levels in the files; the config picks three of them by nearest match (one slightly off on purpose).
SYNTHETIC_LEVELS = (200.0, 300.0, 500.0, 700.0, 850.0)
CONFIG_LEVELS = (300.0, 500.2, 850.0)
#: name: (field type, "3d"/"2d", mean(s), amplitude)
SYNTHETIC_VARIABLES = {
    "temperature": ("prognostic", "3d", (220.0, 230.0, 252.0, 268.0, 276.0), 6.0),
    "u_component_of_wind": ("prognostic", "3d", (22.0, 20.0, 12.0, 8.0, 5.0), 8.0),
    "SP": ("prognostic", "2d", 98000.0, 900.0),
    "VAR_2T": ("prognostic", "2d", 285.0, 8.0),
    "total_precipitation": ("diagnostic", "2d", 0.001, 0.0008),
    "toa_incident_solar_radiation": ("dynamic_forcing", "2d", 1.2e6, 9.0e5),
}
STATIC_VARIABLES = ("z_norm", "land_sea_mask")
FIRST, LAST = np.datetime64("2000-12-29T00", "ns"), np.datetime64("2001-01-03T18", "ns")
STEP = np.timedelta64(6, "h")


def _coordinates(height, width):
    step = 180.0 / (height - 1)
    return np.linspace(90.0, -90.0, height), np.arange(width) * (360.0 / width), step


def _waves(rng, latitude, longitude, times, amplitude):
    """(T, H, W) float64: a few eastward-moving waves of ``amplitude``."""
    lat, lon = np.deg2rad(latitude)[None, :, None], np.deg2rad(longitude)[None, None, :]
    t = np.arange(times, dtype=np.float64)[:, None, None]
    field = np.zeros((times, len(latitude), len(longitude)))
    for _ in range(3):
        m, n = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        a, phase, speed = amplitude * rng.uniform(0.3, 1.0), rng.uniform(0, 2 * np.pi), rng.uniform(0.05, 0.3)
        field += a * np.cos(lat) ** (2 * n) * np.cos(m * lon + phase - speed * m * t)
    return field


def _time_axis():
    count = int((LAST - FIRST) // STEP) + 1
    return FIRST + np.arange(count) * STEP


def write_synthetic_credit(folder, grid=(48, 64), seed=0, *, levels=SYNTHETIC_LEVELS, engine="netcdf", times=None,
                           variables=None, config_levels=CONFIG_LEVELS):
    """Write the dataset into ``folder`` (made if missing); return :func:`synthetic_paths` of it.

    Local, one process (call it on one rank and share the folder). ``grid`` is (latitudes,
    longitudes); latitude runs from 90 to -90 in ``grid[0]`` rows, as in ERA5. Files:
    ``data/era5_synthetic_2000.nc`` and ``..._2001.nc`` (or ``.zarr`` with ``engine="zarr"``),
    ``data/static.nc``, ``mean.nc``, ``std.nc`` (statistics at :data:`CONFIG_LEVELS`' nearest
    levels, statics absent: they pass unscaled), ``scaler.json`` (the same statistics as
    bridgescaler's ``DStandardScalerTensor``; needs ``bridgescaler``). ``times``: the file times
    (default: six-hourly from 2000-12-29 to 2001-01-03T18). ``variables`` (default
    :data:`SYNTHETIC_VARIABLES`) maps names to (field type, "3d"/"2d", mean or per-level means, amplitude);
    ``config_levels`` are the levels the config picks (the statistics are theirs).
    """
    variables = SYNTHETIC_VARIABLES if variables is None else variables
    import xarray as xr

    paths = synthetic_paths(folder, engine)
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    height, width = grid
    latitude, longitude, _ = _coordinates(height, width)
    times = _time_axis() if times is None else np.asarray(times, dtype="datetime64[ns]")
    rng = np.random.default_rng(seed)
    level_values = np.asarray(levels, dtype=np.float64)
    fields, means, stds = {}, {}, {}
    chosen = [int(np.abs(level_values - lv).argmin()) for lv in config_levels]
    for name, (_, dim, mean, amplitude) in variables.items():
        if dim == "3d":
            mean = np.broadcast_to(np.asarray(mean, dtype=np.float64), (len(level_values),))
            stack = [np.float32(m) + (_waves(rng, latitude, longitude, len(times), amplitude)
                     + 0.1 * amplitude * rng.standard_normal((len(times), height, width))).astype(np.float32)
                     for m in mean]
            fields[name] = (("time", "level", "latitude", "longitude"), np.stack(stack, axis=1).astype(np.float32))
            means[name] = (("level",), np.asarray(mean, dtype=np.float32)[chosen])
            stds[name] = (("level",), np.full(len(chosen), amplitude * 0.6, dtype=np.float32))
        else:
            values = mean + _waves(rng, latitude, longitude, len(times), amplitude) \
                + 0.1 * amplitude * rng.standard_normal((len(times), height, width))
            fields[name] = (("time", "latitude", "longitude"), values.astype(np.float32))
            means[name] = ((), np.float32(mean))
            stds[name] = ((), np.float32(amplitude * 0.6))
    coords = {"level": level_values, "latitude": latitude, "longitude": longitude}
    whole = xr.Dataset(fields, coords={"time": times, **coords})
    for year, path in paths["years"].items():
        part = whole.sel(time=slice(f"{year}-01-01", f"{year}-12-31T23"))
        if not part.sizes["time"]:
            continue
        if engine == "zarr":
            part.to_zarr(path, mode="w", consolidated=False)
        else:
            part.to_netcdf(path)
    statics = {
        "z_norm": (("latitude", "longitude"), _waves(rng, latitude, longitude, 1, 1.0)[0].astype(np.float32)),
        "land_sea_mask": (("latitude", "longitude"),
                          (_waves(rng, latitude, longitude, 1, 1.0)[0] > 0.2).astype(np.float32)),
    }
    xr.Dataset(statics, coords={"latitude": latitude, "longitude": longitude}).to_netcdf(paths["static"])
    picked = {"level": np.asarray(config_levels)}
    xr.Dataset(means, coords=picked).to_netcdf(paths["mean"])
    xr.Dataset(stds, coords=picked).to_netcdf(paths["std"])
    _write_scaler(paths["mean"], paths["std"], paths["scaler"], variables)
    return paths


def synthetic_paths(folder, engine="netcdf"):
    """Return the paths :func:`write_synthetic_credit` writes in ``folder`` (a dict); local, pure."""
    suffix = ".zarr" if engine == "zarr" else ".nc"
    data = os.path.join(folder, "data")
    return {
        "years": {year: os.path.join(data, f"era5_synthetic_{year}{suffix}") for year in (2000, 2001)},
        "template": os.path.join(data, f"era5_synthetic_%Y{suffix}"),
        "static": os.path.join(data, "static.nc"),
        "mean": os.path.join(folder, "mean.nc"),
        "std": os.path.join(folder, "std.nc"),
        "scaler": os.path.join(folder, "scaler.json"),
    }


def _write_scaler(mean_path, std_path, out, variables):
    """The statistics as bridgescaler scalers, keyed as CREDIT's batches are (``input`` and ``target``)."""
    import torch
    import xarray as xr
    from bridgescaler import save_scaler_dict
    from bridgescaler.distributed_tensor import DStandardScalerTensor

    mean, std = xr.open_dataset(mean_path), xr.open_dataset(std_path)
    scalers = {"input": {"ERA5": {}}, "target": {"ERA5": {}}}
    for name, (kind, dim, _, _) in variables.items():
        m = np.atleast_1d(np.asarray(mean[name].values, dtype=np.float32))
        s = np.atleast_1d(np.asarray(std[name].values, dtype=np.float32))
        scaler = DStandardScalerTensor(channels_last=False)
        scaler.mean_x_, scaler.var_x_ = torch.tensor(m), torch.tensor(s ** 2)
        scaler.x_columns_, scaler._fit, scaler.n_ = list(range(len(m))), True, 1
        key = f"ERA5/{kind}/{dim}/{name}"
        scalers["input"]["ERA5"][key] = scaler
        if kind in ("prognostic", "diagnostic"):
            scalers["target"]["ERA5"][key] = scaler
    mean.close()
    std.close()
    save_scaler_dict(scalers, out)


def synthetic_config(folder, grid=(48, 64), *, engine="netcdf", save_loc=None, batch=2, batches_per_epoch=5,
                     epochs=2, forecast_len=2, domain=1, variables=None, config_levels=CONFIG_LEVELS):
    """Return the gen2 config (a dict, as ``yaml.safe_load`` gives it) for the files in ``folder``; pure.

    A CREDIT user's config: the ``era5_normalizer`` preblock on the mean/std files, ``loss: {type:
    base}`` with latitude and inverse-variance weights, a slim CrossFormer (``wxformer``) with Earth
    padding, AdamW with linear-warmup-cosine, ``grad_max_norm: dynamic``, EMA, validation.
    """
    paths = synthetic_paths(folder, engine)
    height, width = grid
    spec = SYNTHETIC_VARIABLES if variables is None else variables
    variables = {}
    for name, (kind, dim, _, _) in spec.items():
        group = variables.setdefault(kind, {"path": paths["template"]})
        group.setdefault("vars_3D" if dim == "3d" else "vars_2D", []).append(name)
    variables["static"] = {"vars_2D": list(STATIC_VARIABLES), "path": paths["static"]}
    source = {"dataset_type": "local", "level_coord": "level", "levels": list(config_levels), "variables": variables}
    data = {"source": {"ERA5": source}, "start_datetime": "2000-12-30", "end_datetime": "2001-01-02T06:00:00",
            "timestep": "6h", "history_len": 1, "forecast_len": forecast_len}
    validation = dict(data, start_datetime="2001-01-02T00:00:00", end_datetime="2001-01-03T12:00:00")
    n3d = sum(1 for v in spec.values() if v[:2] == ("prognostic", "3d"))
    n2d = sum(1 for v in spec.values() if v[:2] == ("prognostic", "2d"))
    forcing = sum(1 for v in spec.values() if v[0] == "dynamic_forcing") + len(STATIC_VARIABLES)
    diagnostic = sum(1 for v in spec.values() if v[0] == "diagnostic")
    # Earth padding to a multiple of 64 rows (pad_lat) and 16 columns each side (pad_lon): four stride-2 stages
    # with windows of at most 2 need blocks of 16 rows, so up to (H + pad) / 16 latitude ranks.
    extra = (-height) % 64 or 64
    pad_lat, pad_lon = [extra // 2, extra - extra // 2], [16, 16]
    return {
        "save_loc": save_loc or os.path.join(folder, "run"),
        "seed": 1000,
        "data": data,
        "validation_data": validation,
        "preblocks": {"per_step": {
            "norm": {"type": "era5_normalizer", "args": {"mean_path": paths["mean"], "std_path": paths["std"]}},
            "concat": {"type": "concat"}}},
        "postblocks": {"per_step": {
            "reconstruct": {"type": "reconstruct", "args": {"detach": False}},
            "reconstruct_target": {"type": "reconstruct", "args": {"in_key": "y", "out_key": "y_target_processed"}}}},
        "model": {
            "type": "wxformer", "frames": 1, "image_height": height, "image_width": width,
            "levels": len(config_levels), "channels": n3d, "surface_channels": n2d, "input_only_channels": forcing,
            "output_only_channels": diagnostic, "patch_width": 1, "patch_height": 1, "frame_patch_size": 1,
            "dim": [8, 16, 32, 64], "depth": [1, 1, 1, 1], "dim_head": 4, "global_window_size": [2, 2, 1, 1],
            "local_window_size": 1, "cross_embed_kernel_sizes": [[4, 8], [2, 4], [2, 4], [2, 4]],
            "cross_embed_strides": [2, 2, 2, 2], "attn_dropout": 0.0, "ff_dropout": 0.0, "use_spectral_norm": True,
            "interp": False,
            "padding_conf": {"activate": True, "mode": "earth", "pad_lat": pad_lat, "pad_lon": pad_lon},
        },
        "loss": {"type": "base", "args": {
            "training_loss": "mse", "var_weighting": "inverse_variance", "scaler_path": paths["scaler"],
            "use_latitude_weights": True, "latitude_weights": paths["static"]}},
        "trainer": {
            "type": "era5-gen2", "parallelism": {"data": "ddp", "tensor": 1, "domain": domain},
            "train_batch_size": batch, "valid_batch_size": 1, "batches_per_epoch": batches_per_epoch,
            "valid_batches_per_epoch": 2, "num_epoch": epochs, "epochs": epochs, "start_epoch": 0,
            "learning_rate": 1.0e-3, "weight_decay": 0.01, "use_scheduler": True,
            "scheduler": {"scheduler_type": "linear-warmup-cosine", "warmup_steps": 3, "total_steps": 10,
                          "min_lr": 1.0e-5},
            "amp": False, "activation_checkpoint": False, "compile": False, "grad_accum_every": 1,
            "grad_max_norm": "dynamic", "use_ema": True, "ema_decay": 0.99, "thread_workers": 0,
            "valid_thread_workers": 0, "prefetch_factor": 2, "skip_validation": False, "load_weights": False,
            "save_backup_weights": True, "save_best_weights": True, "stopping_patience": 999,
            "use_tensorboard": False,
        },
    }

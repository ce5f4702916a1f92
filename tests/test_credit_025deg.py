"""CREDIT's own 0.25-degree example config (``config/gen_2/examples/wxformer_era5_025deg_6hr.yml``), shrunk only in
width, depth, dates and paths, trained by ``credit train`` at the world's slabs against CREDIT's one process.

Kept as shipped: model type ``crossformer`` with its padding (earth, 40/40 rows, 80/80 columns), windows
([10, 5, 2, 1] global, 10 local), CrossEmbed kernels and strides, spectral norm and ``interp: True``;
``activation_checkpoint: True``; the flat loss form (``training_loss: mse``, latitude weights, no variable
weights: CREDIT injects the flat variable keys it reads); ``model.post_conf`` with the tracer fixer (dropped
in training, as CREDIT does); ``forecast_len: 1``; EMA, ``grad_max_norm: dynamic``, the scheduler. The grid
is 241 x 160, the smallest with the shipped geometry's shape (241 + 80 = 321 = 2 x 160 + 1 padded rows: the
decoder gives back 320, resampled to 241 as CREDIT's ``interp`` does; 160 + 160 columns), on the synthetic
dataset's variables. One addition: the ``reconstruct`` postblocks of the prediction and the target, without
which CREDIT's own run stops (its metrics read ``y_processed`` and ``y_target_processed``).
"""

import copy
import os

import pytest

from credit_train_support import WORLD, cached, fresh, on_rank0, shared_folder, step_losses, succeeded, train_here

pytestmark = [pytest.mark.credit, pytest.mark.slow]
GRID = (241, 160)
_ONCE = {}


def shipped_config(folder):
    """The shipped config's keys on the synthetic dataset of ``folder`` (a dict)."""
    from mpidomain.credit.synthetic import synthetic_config

    conf = synthetic_config(folder, GRID, batch=1, batches_per_epoch=3, epochs=1, forecast_len=1)
    base = conf["model"]
    conf["model"] = {
        "type": "crossformer", "frames": 1, "image_height": GRID[0], "image_width": GRID[1],
        "levels": base["levels"], "channels": base["channels"], "surface_channels": base["surface_channels"],
        "input_only_channels": base["input_only_channels"], "output_only_channels": base["output_only_channels"],
        "patch_width": 1, "patch_height": 1, "frame_patch_size": 1,
        "dim": [8, 16, 32, 64], "depth": [1, 1, 1, 1], "dim_head": 4,  # shipped: [128, 256, 512, 1024], [2, 2, 8, 2], 32
        "global_window_size": [10, 5, 2, 1], "local_window_size": 10,
        "cross_embed_kernel_sizes": [[4, 8, 16, 32], [2, 4], [2, 4], [2, 4]], "cross_embed_strides": [2, 2, 2, 2],
        "attn_dropout": 0.0, "ff_dropout": 0.0, "interp": True, "use_spectral_norm": True,
        "padding_conf": {"activate": True, "mode": "earth", "pad_lat": [40, 40], "pad_lon": [80, 80]},
        "post_conf": {"activate": True, "tracer_fixer": {"activate": True, "denorm": True,
                                                         "tracer_name": ["specific_total_water"],
                                                         "tracer_thres": [1e-8]}},
    }
    conf["loss"] = {"training_loss": "mse", "use_power_loss": False, "use_spectral_loss": False,
                    "use_latitude_weights": True, "latitude_weights": conf["loss"]["args"]["latitude_weights"],
                    "use_variable_weights": False}
    # The shipped config has no postblocks, and CREDIT's run stops at its metrics (they read y_processed and
    # y_target_processed): the synthetic config's reconstruct pair stays.
    conf["trainer"].update({
        "type": "gen2", "activation_checkpoint": True, "weight_decay": 0, "valid_batch_size": 1,
        "valid_batches_per_epoch": 1, "ema_decay": 0.9999, "grad_max_norm": "dynamic", "amp": False,
        "scheduler": {"scheduler_type": "linear-warmup-cosine", "warmup_steps": 1000, "total_steps": 500000,
                      "min_lr": 1.0e-5}})
    return conf


@pytest.fixture(scope="session")
def quarter_degree(tmp_path_factory):
    """The shrunk config, its data and CREDIT's own one-process run of it (rank 0, once): (conf, reference)."""
    from mpitest import import_credit

    import_credit("credit.models")
    pytest.importorskip("bridgescaler")
    from mpidomain.credit.reference import run_credit_train
    from mpidomain.credit.synthetic import write_synthetic_credit

    if "case" in _ONCE:
        return _ONCE["case"]
    folder = shared_folder(tmp_path_factory, "credit-025deg", kept=True)

    def prepare():
        cached("credit-025deg-data", folder, lambda: write_synthetic_credit(folder, GRID) or folder)
        conf = dict(shipped_config(folder), save_loc=os.path.join(folder, "credit-run"))
        reference = cached("credit-025deg", conf, lambda: run_credit_train(
            conf, os.path.join(folder, "credit-files"), timeout=900), keep=succeeded)
        return {"conf": conf, "reference": reference, "folder": folder}

    outcome = on_rank0("preparing the 0.25-degree case", prepare)
    reference = outcome["reference"]
    if reference["returncode"] != 0 or not reference["steps"]:
        pytest.fail(f"CREDIT's credit train failed (status {reference['returncode']}):\n{reference['output'][-3000:]}")
    _ONCE["case"] = outcome
    return outcome


@pytest.mark.timeout(1500)
def test_the_shipped_quarter_degree_config_trains_as_credit_with_activation_checkpointing(quarter_degree):
    """Per-step losses within 1e-5 of CREDIT's one process at D = the world's ranks (1, 2, 4), with
    activation checkpointing on (CREDIT's crossformer marks no block: nothing is recomputed, as in CREDIT)."""
    if WORLD.size not in (1, 2, 4):
        pytest.skip("slabs of 1, 2 or 4 ranks")
    conf = copy.deepcopy(quarter_degree["conf"])
    conf["save_loc"] = fresh(os.path.join(quarter_degree["folder"], f"ours-{WORLD.size}"))
    train_here(conf, (WORLD.size,))
    _, rows = step_losses(conf["save_loc"])
    reference = quarter_degree["reference"]["steps"]
    assert len(rows) == len(reference) == 3, (rows, reference)
    worst = max(abs(ours - theirs) / abs(theirs) for row, steps in zip(rows, reference)
                for ours, theirs in zip(row[2:], steps))
    assert worst < 1e-5, f"per-step losses differ from CREDIT's by {worst:.2e} (relative): {rows} vs {reference}"

"""Shared pieces of the ``credit train`` tests: the synthetic dataset, CREDIT's reference run (once per test
session), and our training run in the test's own MPI world."""

import copy
import fcntl
import json
import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

from mpitest import import_credit, share

WORLD = MPI.COMM_WORLD
_ONCE = {}  # the session fixtures' values: both test modules import them, and each import is its own fixture
# .ci/run keeps the one-process references (CREDIT's own runs) and their data here between its passes, which
# would each compute the same again; taken out of the environment so that a nested pytest keeps none.
CACHE = os.environ.pop("MPIDOMAIN_TEST_CACHE", None)
LAYOUTS = {  # name: (domain, train_batch_size per group, world size)
    "1": ((1,), 2, 1), "2": ((2,), 2, 2), "4": ((4,), 2, 4), "2x2": ((2, 2), 2, 4), "2 x 2 groups": ((2,), 1, 4),
}


def shared_folder(tmp_path_factory, name, kept=False):
    """A folder made by rank 0, the same path on every rank; ``kept``: with a cache, the same in every pass (for
    the one-process references and their data only: every other folder is new in each pass)."""
    if CACHE and kept:
        path = os.path.join(CACHE, name)
        if WORLD.rank == 0:
            os.makedirs(path, exist_ok=True)
        return share(WORLD, path)
    path = str(tmp_path_factory.mktemp(name)) if WORLD.rank == 0 else None
    return share(WORLD, path)


def cached(name, key, compute, keep=lambda value: True):
    """``compute()``, or with a cache the value an earlier pass computed for the same ``key`` (JSON). Rank 0
    only (the others get it shared); a value ``keep`` refuses (a failed run) is not kept."""
    path = os.path.join(CACHE, f"{name}.json") if CACHE else None
    if path is None:
        return compute()
    with open(path + ".lock", "w") as lock:  # two passes at once (CI's serial pass runs in two): one computes
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached(path, key, compute, keep)


def _cached(path, key, compute, keep):
    key = json.loads(json.dumps(key))  # as it reads back
    try:
        with open(path) as file:
            saved = json.load(file)
        if saved["key"] == key:
            return saved["value"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: computed afresh
        pass
    value = compute()
    try:
        if keep(value):
            write_json(path + ".partial", {"key": key, "value": value})
            os.replace(path + ".partial", path)
    except (OSError, TypeError, ValueError):  # not kept: the next pass computes it again
        pass
    return value


def on_rank0(what, compute):
    """``compute()`` on rank 0 and its value on every rank; an exception there fails the test on every rank."""
    outcome = None
    if WORLD.rank == 0:
        try:
            outcome = {"value": compute()}
        except Exception as exc:  # noqa: BLE001 - shared, then failed on every rank
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
    outcome = share(WORLD, outcome)
    if "error" in outcome:
        pytest.fail(f"{what} failed: {outcome['error']}")
    return outcome["value"]


@pytest.fixture(scope="session")
def credit_data(tmp_path_factory):
    """The synthetic CREDIT dataset (written once by rank 0) and its config: ``(folder, conf)``."""
    import_credit("credit.models")
    pytest.importorskip("bridgescaler")
    from mpidomain.credit.synthetic import synthetic_config, write_synthetic_credit

    if "data" in _ONCE:
        return _ONCE["data"]

    folder = shared_folder(tmp_path_factory, "credit-data", kept=True)
    on_rank0("writing the synthetic dataset",
             lambda: cached("credit-data", folder, lambda: write_synthetic_credit(folder) or folder))
    _ONCE["data"] = folder, synthetic_config(folder)
    return _ONCE["data"]


@pytest.fixture(scope="session")
def credit_reference(credit_data):
    """CREDIT's own ``credit train`` of the synthetic config in one process (rank 0, a subprocess), once per
    session: ``{"steps": per-step losses, "valid": ..., "save_loc": its folder}``."""
    from mpidomain.credit.reference import run_credit_train

    if "reference" in _ONCE:
        return _ONCE["reference"]
    folder, conf = credit_data
    conf = copy.deepcopy(conf)
    conf["save_loc"] = os.path.join(folder, "credit-run")
    result = None
    if WORLD.rank == 0:
        try:
            result = cached("credit-reference", conf, lambda: run_credit_train(
                conf, os.path.join(folder, "credit-reference"), timeout=600), keep=succeeded)
        except Exception as exc:  # noqa: BLE001
            result = {"returncode": -1, "output": f"{type(exc).__name__}: {exc}", "steps": []}
        result["save_loc"] = conf["save_loc"]
    result = share(WORLD, result)
    if result["returncode"] != 0 or not result["steps"]:
        pytest.fail(f"CREDIT's credit train failed (status {result['returncode']}):\n{result['output'][-3000:]}")
    _ONCE["reference"] = result
    return result


ACCUMULATION = {"grad_accum_every": 2, "activation_checkpoint": True, "grad_max_norm": 0.5}
DROPOUT = {"attn_dropout": 0.1, "ff_dropout": 0.1}  # drawn as one process draws them: --rng one-process


def accumulating_conf(conf, save_loc):
    """``conf`` with :data:`ACCUMULATION`'s trainer keys and :data:`DROPOUT` in the model."""
    conf = layout_conf(conf, save_loc, **ACCUMULATION)
    conf["model"].update(DROPOUT)
    return conf


@pytest.fixture(scope="session")
def credit_reference_accumulating(credit_data):
    """CREDIT's ``credit train`` with gradient accumulation over 2 steps, activation checkpointing, a numeric
    ``grad_max_norm`` and dropout in the model (rank 0, once per session)."""
    if "accumulating" not in _ONCE:
        folder, conf = credit_data
        _ONCE["accumulating"] = _credit_run("credit-accumulating", accumulating_conf(
            conf, os.path.join(folder, "credit-accumulating")), os.path.join(folder, "credit-accumulating-files"))
    return _ONCE["accumulating"]


def _credit_run(name, conf, files):
    """CREDIT's own ``credit train`` of ``conf`` on rank 0 (cached under ``name``; its files in ``files``), shared
    with every rank; a failed run fails the test on every rank."""
    from mpidomain.credit.reference import run_credit_train

    result = None
    if WORLD.rank == 0:
        try:
            result = cached(name, conf, lambda: run_credit_train(conf, files, timeout=600), keep=succeeded)
        except Exception as exc:  # noqa: BLE001 - shared below, raised on every rank
            result = {"returncode": -1, "output": f"{type(exc).__name__}: {exc}", "steps": []}
        result["save_loc"] = conf["save_loc"]
    result = share(WORLD, result)
    if result["returncode"] != 0 or not result["steps"]:
        pytest.fail(f"CREDIT's credit train failed (status {result['returncode']}):\n{result['output'][-3000:]}")
    return result


def ensemble_conf(credit_data, save_loc):
    """CREDIT's ``config/gen_2/smoke/smoke_ensemble_gen2_casper.yml`` on the synthetic data, shrunk only in grid,
    model, dates and paths: the flat ``KCRPS`` training loss (``mse`` in validation), ``trainer.ensemble_size: 2``,
    ``attn_dropout: 0.1``, ``forecast_len: 1``, batches of 1, bridgescaler pre- and postblocks, its optimizer,
    clipping and scheduler. One addition: the target twin (``reconstruct_target`` and its inverse scaling), without
    which CREDIT's default metrics stop at the first step (KeyError ``y_target_processed``)."""
    from mpidomain.credit.synthetic import synthetic_paths

    folder, conf = credit_data
    scaler = synthetic_paths(folder)["scaler"]
    conf = layout_conf(conf, save_loc, batch=1, valid_batch_size=1, ensemble_size=2, grad_max_norm=1.0,
                       weight_decay=0, use_ema=False, use_scheduler=True, scheduler={
                           "scheduler_type": "cosine-annealing-restarts", "first_cycle_steps": 50, "cycle_mult": 1.0,
                           "max_lr": 1.0e-3, "min_lr": 1.0e-6, "warmup_steps": 10, "gamma": 1.0})
    for block in ("data", "validation_data"):
        conf[block]["forecast_len"] = 1
    variables = conf["data"]["source"]["ERA5"]["variables"]
    keys = lambda *kinds: [f"ERA5/{kind}/{dim}/{name}" for kind in kinds  # noqa: E731
                           for dim, group in (("3d", "vars_3D"), ("2d", "vars_2D"))
                           for name in (variables.get(kind) or {}).get(group, [])]
    scale = lambda method, chosen, **args: {"type": "bridgescaler_transform", "args": dict(  # noqa: E731
        scaler_path=scaler, variables=chosen, method=method, **args)}
    conf["preblocks"] = {"per_step": {"scaler": scale("transform", keys("prognostic", "dynamic_forcing"),
                                                      scaler_params={"channels_last": False}),
                                      "concat": {"type": "concat"}}}
    outputs = keys("prognostic", "diagnostic")
    conf["postblocks"] = {"per_step": {
        "reconstruct": {"type": "reconstruct"}, "scaler": scale("inverse_transform", outputs),
        "reconstruct_target": {"type": "reconstruct", "args": {"in_key": "y", "out_key": "y_target_processed"}},
        "scaler_target": scale("inverse_transform", outputs, key="y_target_processed")}}
    conf["loss"] = {"training_loss": "KCRPS", "validation_loss": "mse", "use_power_loss": False,
                    "use_spectral_loss": False, "use_latitude_weights": False,
                    "latitude_weights": variables["static"]["path"], "use_variable_weights": False}
    conf["model"].update(attn_dropout=0.1, ff_dropout=0.0, interp=True)
    return conf


@pytest.fixture(scope="session")
def credit_reference_ensemble(credit_data):
    """CREDIT's ``credit train`` of :func:`ensemble_conf` (rank 0, once per session)."""
    if "ensemble" not in _ONCE:
        folder = credit_data[0]
        _ONCE["ensemble"] = _credit_run("credit-ensemble", ensemble_conf(credit_data, os.path.join(
            folder, "credit-ensemble")), os.path.join(folder, "credit-ensemble-files"))
    return _ONCE["ensemble"]


def succeeded(result):
    """True for a reference run that ended well and recorded steps."""
    return result["returncode"] == 0 and bool(result["steps"])


def layout_conf(conf, save_loc, batch=None, **trainer):
    """``conf`` with its own ``save_loc`` (and trainer keys)."""
    conf = copy.deepcopy(conf)
    conf["save_loc"] = save_loc
    if batch is not None:
        conf["trainer"]["train_batch_size"] = batch
    conf["trainer"].update(trainer)
    return conf


def train_here(conf, domain, options=None):
    """Train ``conf`` in this test's world at ``domain`` (a tuple); return the run's summary."""
    import torch

    from mpidomain.credit.config import read_settings
    from mpidomain.credit.trainer import TrainOptions, train
    from mpidomain.manager import initialize_domain_parallel

    settings = read_settings(conf, WORLD.size, tuple(domain))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    manager = initialize_domain_parallel(WORLD.size, domain if len(domain) == 2 else domain[0],
                                         (-2, -1) if len(domain) == 2 else -2)
    try:
        return train(settings, options or TrainOptions(progress=False), manager, say=lambda line: None)
    finally:
        manager.close()
        torch.set_num_threads(threads)


def fresh(folder):
    """Empty ``folder`` (rank 0), then every rank goes on."""
    if WORLD.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    share(WORLD, None)
    return folder


def step_losses(save_loc):
    """``training_steps.csv`` as a list of rows of floats (``step, train_loss, loss_t1, ...``)."""
    import csv

    with open(os.path.join(save_loc, "training_steps.csv"), newline="") as file:
        rows = list(csv.reader(file))
    return rows[0], [[float(v) for v in row] for row in rows[1:]]


def relative_weights_difference(a, b):
    """The relative norm ``|a - b| / |b|`` over every floating tensor of two state dicts (same keys)."""
    num = den = 0.0
    for key, value in b.items():
        if value.is_floating_point():
            num += float((a[key].double() - value.double()).norm() ** 2)
            den += float(value.double().norm() ** 2)
    return (num / den) ** 0.5 if den else 0.0 if num == 0 else float("inf")


def temporary_folder():
    """A folder on every rank's file system, made by rank 0."""
    return share(WORLD, tempfile.mkdtemp(prefix="credit-train-") if WORLD.rank == 0 else None)


def write_json(path, value):
    with open(path, "w") as file:
        json.dump(value, file)

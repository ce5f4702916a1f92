"""CREDIT's own ``credit train`` and ``credit rollout`` on a config, in a subprocess, with its 2026.2.0 defects
corrected.

The reference a domain-parallel run is compared with: CREDIT's application entry point
(``credit.applications.train_gen2.main_cli``) in one process on the CPU, float32, one torch
thread, or under ``torchrun`` for CREDIT's own domain-parallel trainer. Two minimal patches,
applied in the subprocess only, make it do what CREDIT intends:

- ``loss: {type: base}`` with ``forecast_len > 1``: 2026.2.0's ``train_one_epoch`` detaches the
  prediction (``_gather_for_next_step``) before the loss reads it ("BaseLoss: y_processed carries
  no gradient"). The patch defers that detach (and CREDIT's gather) to the moment the next step's
  input is assembled, after the step's loss and backward.
- ``era5_normalizer`` has no inverse postblock, so from rollout step 2 CREDIT normalises the fed-back
  prediction twice. :func:`credit_config` replaces it by ``bridgescaler_transform`` pre and post
  blocks built by CREDIT's own converter (``credit convert``) from the same mean/std files.

The subprocess records every training loss ``BaseLoss`` returns (per rollout step, grouped by
optimizer step) and writes them, with the validation losses, to a JSON file.

``credit rollout`` (:func:`run_credit_rollout`: ``credit.applications.rollout_gen2.main`` in one process,
CPU, float32, one torch thread) needs no patch of its code, only a config that does what CREDIT intends
(:func:`credit_rollout_config`): the second defect's correction as above, and ``inference.postblocks``
without the blocks that reconstruct and un-normalise the target twin (``in_key: y``), which a forecast has
no target for (CREDIT's own example config fails there with ``KeyError: 'y'``).
"""

import copy
import json
import os
import subprocess
import sys

__all__ = ["credit_config", "run_credit_train", "credit_rollout_config", "run_credit_rollout", "credit_checkpoint",
           "CREDIT_DEFECTS"]

CREDIT_DEFECTS = (
    "loss type base with forecast_len > 1: the prediction is detached before the loss reads it; the reference "
    "detaches it for the next step's input only, after the step's backward",
    "era5_normalizer has no inverse postblock (the fed-back prediction is normalised twice from step 2); the "
    "reference uses bridgescaler_transform pre/post blocks built by CREDIT's converter from the same files",
)

# Variables a launcher sets: a reference run in one process must not inherit the caller's MPI job.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPI_LOCAL", "HYDI_", "HYDRA_", "OMPI_", "PRTE_", "PALS_", "SLURM_",
                      "ALPS_", "JSM_", "I_MPI_", "TORCHELASTIC_")
_TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _var_groups(source):
    groups = {}
    for kind, group in (source.get("variables") or {}).items():
        if not isinstance(group, dict):
            continue
        for dim, key in (("3d", "vars_3D"), ("2d", "vars_2D")):
            if group.get(key):
                groups[(kind, dim)] = list(group[key])
    return groups


def credit_config(conf, folder):
    """Return ``conf`` as CREDIT 2026.2.0 needs it to train as intended; write its scaler files in ``folder``.

    Each ``era5_normalizer`` preblock becomes ``bridgescaler_transform`` built by CREDIT's converter
    (``credit.cli._convert._build_bridgescaler_jsons``) from the same mean/std files, and the per-step
    postblocks gain the inverse after each ``reconstruct`` (of the prediction and of the target twin).
    Local; needs CREDIT and bridgescaler.
    """
    from credit.cli._convert import _build_bridgescaler_jsons

    conf = copy.deepcopy(conf)
    os.makedirs(folder, exist_ok=True)
    source_name, source = next(iter(conf["data"]["source"].items()))
    per_step = dict((conf.get("preblocks") or {}).get("per_step") or {})
    converted, post_json = {}, None
    for name, block in per_step.items():
        if block.get("type") != "era5_normalizer":
            converted[name] = block
            continue
        args = block.get("args") or {}
        pre_json = os.path.join(folder, f"{name}_pre_scaler.json")
        post_json = os.path.join(folder, f"{name}_post_scaler.json")
        keys, _ = _build_bridgescaler_jsons(args["mean_path"], args["std_path"], _var_groups(source), pre_json,
                                            post_json, source_name=source_name)
        converted[name] = {"type": "bridgescaler_transform",
                           "args": {"scaler_path": pre_json, "variables": keys, "method": "transform"}}
    conf.setdefault("preblocks", {})["per_step"] = converted
    if post_json is not None:
        post = {}
        for name, block in ((conf.get("postblocks") or {}).get("per_step") or {}).items():
            post[name] = block
            if block.get("type") == "reconstruct":
                key = (block.get("args") or {}).get("out_key", "y_processed")
                post[f"{name}_inverse_scaler"] = {"type": "bridgescaler_transform", "args": {
                    "scaler_path": post_json, "variables": [], "method": "inverse_transform", "key": key}}
        conf.setdefault("postblocks", {})["per_step"] = post
    return conf


def credit_rollout_config(conf, folder):
    """Return ``conf`` as CREDIT 2026.2.0's ``credit rollout`` needs it to forecast as intended; write its scaler
    files in ``folder``.

    :func:`credit_config`'s conversion, then ``inference.postblocks`` (unless the config has its own): the
    per-step postblocks without those of the target twin (a ``reconstruct`` with ``in_key: y`` and the blocks
    that act on its ``out_key``). Local; needs CREDIT and bridgescaler.
    """
    conf = credit_config(conf, folder)
    inference = conf.setdefault("inference", {})
    if inference.get("postblocks") is None:
        per_step = (conf.get("postblocks") or {}).get("per_step") or {}
        twins = {(b.get("args") or {}).get("out_key", "y_processed") for b in per_step.values()
                 if isinstance(b, dict) and b.get("type") == "reconstruct" and (b.get("args") or {}).get("in_key") == "y"}
        kept = {name: block for name, block in per_step.items()
                if not (block.get("type") == "reconstruct" and (block.get("args") or {}).get("in_key") == "y")
                and (block.get("args") or {}).get("key") not in twins}
        inference["postblocks"] = {"per_step": kept}
    return conf


def credit_checkpoint(conf, path, warmup=2, seed=5):
    """Write a checkpoint of ``conf``'s model in CREDIT's layout (``epoch``, ``model_state_dict``) to ``path``.

    CREDIT's ``load_model(conf)`` after ``seed_everything(conf["seed"])``, as its trainer leaves the model after
    ``warmup`` steps' forwards in training mode (on seeded random inputs of the config's channels): the
    spectral norm's power iterations have run (an untrained model's first estimate of the largest singular
    values is far off, and its forecasts reach 1e18). Local; needs CREDIT.
    """
    import torch
    from credit.models import load_model
    from credit.seed import seed_everything

    from ..models import credit_crossformer_module

    credit_crossformer_module()  # credit.postblock.gen1 (torchvision) replaced where it cannot import
    conf = copy.deepcopy(conf)
    conf["model"].pop("post_conf", None)
    seed_everything(conf.get("seed", 42))
    model = load_model(conf)
    model_conf = conf["model"]
    channels = (model_conf["channels"] * model_conf["levels"] + model_conf["surface_channels"]
                + model_conf.get("input_only_channels", 0))
    shape = (1, channels, model_conf.get("frames", 1), model_conf["image_height"], model_conf["image_width"])
    generator = torch.Generator().manual_seed(seed)
    model.train()
    with torch.no_grad():
        for _ in range(warmup):
            model(torch.randn(shape, generator=generator))
    torch.save({"epoch": 0, "model_state_dict": model.state_dict()}, path)


def run_credit_rollout(config, *, timeout=900, python=sys.executable):
    """Forecast with CREDIT's ``credit rollout`` on the config file ``config`` in a subprocess (CPU, one process).

    The config must be one CREDIT runs as intended (:func:`credit_rollout_config`). Returns ``{"returncode":
    int, "output": str}``; the files go where the config's ``inference.save_forecast`` says. Local; call on one
    rank.
    """
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    program = [python, "-m", "mpidomain.credit.reference", "rollout", config]
    done = subprocess.run(program, env=_clean_environment(env), capture_output=True, text=True, timeout=timeout)
    return {"returncode": done.returncode, "output": (done.stdout + done.stderr)[-20000:]}


def _rollout_main(config):
    """CREDIT's ``credit rollout -c config -p 1`` in this process, the torchvision stand-in installed."""
    import torch

    torch.set_num_threads(1)
    from ..models import credit_crossformer_module

    credit_crossformer_module()  # credit.postblock.gen1 (torchvision) replaced where it cannot import
    from credit.applications.rollout_gen2 import main

    sys.argv = ["credit-rollout", "-c", config, "-p", "1"]
    main()


def _clean_environment(extra=None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _TORCH_VARIABLES}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"})
    env.update(extra or {})
    return env


def run_credit_train(conf, folder, *, domain=1, timeout=900, python=sys.executable):
    """Train ``conf`` with CREDIT's ``credit train`` in a subprocess; return what it recorded (a dict).

    ``conf`` is a gen2 config (a dict); its ``era5_normalizer`` blocks are converted first
    (:func:`credit_config`). ``folder`` holds the converted config, its scaler files and the record;
    the run's ``save_loc`` is the config's. ``domain`` > 1 runs CREDIT's own domain-parallel trainer
    under ``torchrun --nproc-per-node domain`` with the gloo backend (``parallelism: {data: none,
    domain: D}``). Returns ``{"steps": [[loss_t1, ...], ...], "valid": [...], "returncode": int,
    "output": str}``; ``steps`` holds rank 0's per-step losses. Local; call on one rank.
    """
    import yaml

    os.makedirs(folder, exist_ok=True)
    conf = credit_config(conf, folder)
    if domain > 1:
        conf["trainer"]["parallelism"] = {"data": "none", "tensor": 1, "domain": domain}
    config = os.path.join(folder, "credit_config.yml")
    with open(config, "w") as file:
        yaml.safe_dump(conf, file, sort_keys=False)
    record = os.path.join(folder, "credit_losses.json")
    if os.path.exists(record):
        os.remove(record)
    program = [python, "-m", "mpidomain.credit.reference", config, record]
    env = {}
    if domain > 1:
        program = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(domain), "--master-addr",
                   "127.0.0.1", "--master-port", str(29500 + os.getpid() % 1000), "-m",
                   "mpidomain.credit.reference", config, record, "--backend", "gloo"]
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(program, env=_clean_environment(env), capture_output=True, text=True, timeout=timeout)
    result = {"steps": [], "valid": []}
    if os.path.exists(record):
        with open(record) as file:
            result = json.load(file)
    result["returncode"] = done.returncode
    result["output"] = (done.stdout + done.stderr)[-20000:]
    return result


def _patch_credit(record):
    """Install the torchvision stand-in, the defect-1 correction and the loss recorder (this process only)."""
    import torch

    torch.set_num_threads(1)
    from ..models import credit_crossformer_module

    credit_crossformer_module()  # credit.postblock.gen1 (torchvision) replaced where it cannot import
    import credit.trainers.trainer_gen2 as trainer_gen2
    from credit.losses.base import BaseLoss

    original_gather = trainer_gen2.TrainerERA5Gen2._gather_for_next_step
    original_assemble = trainer_gen2.assemble_rollout_batch
    pending = []

    def defer_gather(self, full_data_dict):
        pending[:] = [(self, full_data_dict)]

    def assemble_after_backward(full_data_dict, curr_batch, *args, **kwargs):
        if pending:  # the previous step's loss and backward are done: detach (and gather) for this input only
            trainer, state = pending.pop()
            original_gather(trainer, state)
        return original_assemble(full_data_dict, curr_batch, *args, **kwargs)

    trainer_gen2.TrainerERA5Gen2._gather_for_next_step = defer_gather
    trainer_gen2.assemble_rollout_batch = assemble_after_backward
    original_forward = BaseLoss.forward

    def recording_forward(self, full_data_dict):
        loss = original_forward(self, full_data_dict)
        (record["train"] if torch.is_grad_enabled() else record["valid"]).append(float(loss.detach()))
        return loss

    BaseLoss.forward = recording_forward
    from credit.losses.gen_1.weighted_loss import VariableTotalLoss2D

    original_flat = VariableTotalLoss2D.forward

    def recording_flat(self, target, pred):  # the flat form: the trainer takes the mean of what it returns
        loss = original_flat(self, target, pred)
        (record["train"] if torch.is_grad_enabled() else record["valid"]).append(float(loss.detach().mean()))
        return loss

    VariableTotalLoss2D.forward = recording_flat
    import credit.losses

    original_load = credit.losses.load_loss

    class Recording(torch.nn.Module):  # a plain registry loss (KCRPS, mse): the trainer takes the mean of it
        def __init__(self, criterion):
            super().__init__()
            self.criterion = criterion

        def forward(self, target, pred):
            loss = self.criterion(target, pred)
            (record["train"] if torch.is_grad_enabled() else record["valid"]).append(float(loss.detach().mean()))
            return loss

    def recording_load(*args, **kwargs):
        criterion = original_load(*args, **kwargs)
        return criterion if isinstance(criterion, (BaseLoss, VariableTotalLoss2D)) else Recording(criterion)

    credit.losses.load_loss = recording_load


def _main(argv):
    config, out = argv[0], argv[1]
    rest = argv[2:]
    record = {"train": [], "valid": []}
    _patch_credit(record)
    import yaml

    with open(config) as file:
        conf = yaml.safe_load(file)
    data = conf["data"]
    per_step = len(conf["trainer"].get("backprop_on_timestep") or data.get("backprop_on_timestep")
                   or range(1, data["forecast_len"] + 1))
    from credit.applications.train_gen2 import main_cli

    sys.argv = ["credit-train", "-c", config, *rest]
    try:
        main_cli()
    finally:
        if int(os.environ.get("RANK", "0")) == 0:
            train = record["train"]
            steps = [train[i:i + per_step] for i in range(0, len(train), per_step)]
            with open(out, "w") as file:
                json.dump({"steps": steps, "valid": record["valid"]}, file)


if __name__ == "__main__":  # spawned helpers (credit rollout's pool) import this module as __mp_main__
    if sys.argv[1:2] == ["rollout"]:
        _rollout_main(sys.argv[2])
    else:
        _main(sys.argv[1:])

"""CREDIT's gen2 training (``TrainerERA5Gen2.fit``) on tiles: :func:`train`.

Each rank reads its tile of every sample, runs the domain-parallel model on it and rolls out as
CREDIT 2026.2.0 does, step by step: at rollout step 1 the sample's input; at step ``t + 1`` the
prognostics are step ``t``'s ``y_processed`` (physical units, detached after step ``t``'s loss and
backward: what CREDIT intends), the statics step 1's raw fields, the dynamic forcing and the target
loader batch ``t + 1``'s, normalised again by the per-step preblocks. ``(loss_t / grad_accum_every)``
is backpropagated on each step of ``backprop_on_timestep``; at the accumulation boundary the
domain group sums its parameter gradients (the whole field's), the data-parallel groups average
them (``ddp``/``fsdp2``), clipping uses the true global norm (every parameter once), then
AdamW, the scheduler and the EMA step. Logs: ``save_loc/training_log.csv`` with CREDIT's columns
(epoch means) and ``save_loc/training_steps.csv`` (each step's summed loss and its rollout steps').
"""

import csv
import math
import os
import shutil
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, replace
from typing import Optional, Tuple

import numpy as np
import pandas as pd
import torch

from .._agreement import agree
from .._errors import raised_alike
from ..command import UsageError, agreed, probe_writable
from ..manager import library_comm
from ..nn import allreduce_gradients
from ..preemption import StopSignals
from ..reduce import reduce_array
from .blocks import Blocks
from .checkpoints import FORMAT, EpochFiles, newest_state, pack_rng, read_checkpoint, step_folder, unpack_rng
from .dataset import CreditTileDataset, plan_source, source_clock
from .loss import TileLoss, TileMetrics
from .model import build_model, training_conf, training_wrappers, unwrapped

__all__ = ["TrainOptions", "train", "assemble_inputs"]

DEFAULT_DISPLAY_METRICS = ("rmse", "r2score", "bias")
_COLUMN_ORDER = ["index", "epoch", "train_history_len", "train_forecast_len", "valid_history_len",
                 "valid_forecast_len", "train_loss", "valid_loss", "train_rmse", "valid_rmse", "train_r2score",
                 "valid_r2score", "train_bias", "valid_bias", "train_acc", "valid_acc", "train_mae", "valid_mae"]


@dataclass(frozen=True)
class TrainOptions:
    """The command line's choices beyond the config."""

    resume: Optional[str] = None            # a checkpoint path, "auto", or None
    checkpoint_every: Optional[int] = None  # numbered step checkpoints every N optimizer steps
    keep: int = 3                           # numbered checkpoints kept
    stop_signals: Tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    skip_nan: bool = False                  # as trainer.skip_nan_prune
    stop_after: Optional[int] = None        # stop after this optimizer step with a numbered checkpoint
    config_path: Optional[str] = None       # copied to save_loc/model.yml, as credit train does
    progress: bool = True
    amp: Optional[str] = None               # "bf16": autocast to bfloat16 (overrides trainer.amp)
    rng: str = "tile"                       # how the converted model's dropout draws (mpidomain.nn.rng)


class _Skip(torch.utils.data.Sampler):
    """CREDIT's batch sampler, its first ``skip`` index batches passed over once (a resumed epoch)."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        batches, self.skip, skip = iter(self.sampler), 0, self.skip
        for _ in range(skip):
            next(batches, None)
        return batches

    def __len__(self):
        return len(self.sampler)

    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)


def assemble_inputs(ic_raw, prediction, current, history_len):
    """Return the raw inputs of rollout step ``t + 1``, as CREDIT's ``assemble_rollout_batch`` builds them.

    Prognostics from ``prediction`` (step ``t``'s ``y_processed``, physical units), dynamic forcing from
    ``current`` (the loader batch of step ``t + 1``), the rest (statics) from the first step's raw input
    ``ic_raw`` (its newest time with a history); in ``ic_raw``'s key order; diagnostics are not inputs. Local.
    """
    def newest(tensor):
        return tensor[:, :, -1:] if history_len > 1 and tensor.dim() >= 3 and tensor.shape[2] > 1 else tensor

    assembled = {}
    for key, tensor in ic_raw.items():
        kind = key.split("/")[1]
        if kind in ("prognostic", "diagnostic"):
            assembled[key] = prediction[key] if key in prediction else newest(tensor)
        elif kind == "dynamic_forcing":
            assembled[key] = current[key] if key in current else newest(tensor)
        else:
            assembled[key] = newest(tensor)
    return assembled


def _loader(dataset, batch, forecast_len, settings, replicas, rank, shuffle, workers):
    from credit.samplers import DistributedMultiStepBatchSampler

    sampler = _Skip(DistributedMultiStepBatchSampler(dataset, batch_size=batch, num_forecast_steps=forecast_len,
                                                     num_replicas=replicas, rank=rank, shuffle=shuffle,
                                                     seed=settings.conf.get("seed", 42)))
    options = {}
    if workers > 0:  # spawned workers: they import the dataset's modules afresh and never start MPI
        options = dict(num_workers=workers, prefetch_factor=settings.prefetch_factor, persistent_workers=True,
                       multiprocessing_context="spawn")
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, pin_memory=torch.cuda.is_available(),
                                         **options)
    return loader, sampler


def _cycle(loader):
    while True:
        for batch in loader:
            yield batch


class _Run:
    """One ``credit train`` run on this rank: the manager, data, model, optimizer and what was logged."""

    def __init__(self, settings, options, manager, say):
        self.settings, self.options, self.manager, self.say = settings, options, manager, say
        self.world = library_comm(manager, "world")
        self.dp_comm = library_comm(manager, "data")
        self.rank = self.world.Get_rank()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        self.forecast_len = settings.data.forecast_len
        self.history = defaultdict(list)
        self.step = 0
        self.bytes_read = 0
        self.skipped = []
        self.step_seconds = []

    # -- setup -----------------------------------------------------------------------------------------
    def prepare(self):
        from credit.seed import seed_everything

        settings, world = self.settings, self.world

        def make_folder():
            if self.rank == 0:
                try:
                    os.makedirs(settings.save_loc, exist_ok=True)
                    probe_writable(settings.save_loc)
                except OSError as error:
                    raise UsageError(f"save_loc = {settings.save_loc!r}: cannot write there ({type(error).__name__}: "
                                     f"{error.strerror or error}); choose a folder this job can write") from None
        agreed(world, "credit train: save_loc", make_folder)

        def visible():
            if not os.path.isdir(settings.save_loc):
                raise UsageError(f"save_loc = {settings.save_loc!r}: made by rank 0 but not seen here; use a folder "
                                 "on a file system every rank shares")
        agreed(world, "credit train: save_loc on every rank", visible)
        model_conf = settings.conf.get("model") or {}
        shape = (model_conf.get("image_height"), model_conf.get("image_width"))
        self.train_plan, self.valid_plan = plan_source(world, (settings.data, settings.valid), self.manager,
                                                       shape if None not in shape else None)
        self.rows = self.train_plan.rows
        self.blocks = agreed(world, "credit train: the pre- and postblocks", lambda: Blocks(settings.conf, settings))
        seed_everything(settings.seed)  # every rank builds the same weights, those of credit train
        model = agreed(world, "credit train: building the model",
                       lambda: build_model(settings.conf, self.manager, self.device, self.options.rng))
        self.model, self.autocast, self.scaler, self.stack, checkpointed = training_wrappers(
            model, settings, self.device, self.manager, self.options.amp)
        if settings.activation_checkpoint and not checkpointed:
            self.say(f"trainer.activation_checkpoint: model type {settings.conf['model'].get('type')!r} marks no "
                     "block for checkpointing (_fsdp2_shard), so nothing is recomputed (as CREDIT's train_gen2)")
        seed_everything(settings.seed + self.manager.dp_rank)  # per data-parallel group, as credit train
        self.loss = agreed(world, "credit train: the loss", lambda: TileLoss(
            settings.conf, self.manager, self.rows, self.train_plan.shape[0]))
        self.valid_loss = agreed(world, "credit train: the validation loss", lambda: TileLoss(
            settings.conf, self.manager, self.rows, self.train_plan.shape[0], validation=True))
        self.metrics = agreed(world, "credit train: the metrics", lambda: TileMetrics(settings.conf, self.manager,
                                                                                     self.rows))
        from credit.losses import effective_loss_name, is_crps_loss

        # CREDIT's is_crps_ensemble: logs the members' error spread (train_std)
        self.crps_ensemble = settings.ensemble_size > 1 and is_crps_loss(effective_loss_name(settings.conf["loss"]))
        self._optimizer()
        if self.rank == 0:
            self._write_run_files()

    def _write_run_files(self):
        from credit.datasets.gen_2.channel_utils import DEFAULT_SCHEMA_FILENAME, ChannelSchema

        save_loc = self.settings.save_loc
        config = self.options.config_path
        if config and not os.path.exists(os.path.join(save_loc, "model.yml")):
            shutil.copy(config, os.path.join(save_loc, "model.yml"))
        ChannelSchema.from_config(self.settings.conf).save(os.path.join(save_loc, DEFAULT_SCHEMA_FILENAME))

    def _optimizer(self):
        from credit.scheduler import load_scheduler
        from credit.trainers.base_trainer import EMATracker

        settings = self.settings
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, weight_decay=settings.weight_decay,
                                           betas=(0.9, 0.95))
        if self.loss.parameters:
            self.optimizer.add_param_group({"params": self.loss.parameters})
        conf = dict(settings.conf, trainer=dict(settings.conf["trainer"], use_scheduler=settings.use_scheduler))
        self.scheduler = agreed(self.world, "credit train: trainer.scheduler",
                                lambda: _scheduler(load_scheduler, self.optimizer, conf))
        self.ema = EMATracker(unwrapped(self.model), decay=settings.ema_decay) if settings.use_ema else None

    # -- resuming --------------------------------------------------------------------------------------
    def restore(self):
        """Apply ``--resume`` or CREDIT's ``load_weights`` keys; return (start epoch, steps done in it)."""
        settings, options = self.settings, self.options
        start_epoch, epoch_step = settings.start_epoch, 0
        state, path = None, None
        if options.resume == "auto":
            path, state, skipped = newest_state(self.world, settings.save_loc, options.keep, self._epoch_steps())
            for skipped_path, reason in skipped:
                self.say(f"warning: --resume auto skips {skipped_path}: {reason}")
            if state is None:
                self.say(f"--resume auto: no complete checkpoint in {settings.save_loc}; starting fresh")
        elif options.resume:
            path = options.resume
            state = read_checkpoint(self.world, path)
        if state is not None:
            return self._resume(state, path)
        if settings.load_weights:
            path = os.path.join(settings.save_loc, "checkpoint.pt")
            state = read_checkpoint(self.world, path, "trainer.load_weights: true reads")
            self._load_weights(state, path, strict=False)
            loads = settings.load_optimizer or settings.load_scaler or settings.load_scheduler
            if settings.reload_epoch and (loads or os.path.exists(os.path.join(settings.save_loc, "training_log.csv"))):
                start_epoch = int(state["epoch"]) + 1
            if loads:
                if settings.load_optimizer:
                    self.optimizer.load_state_dict(state["optimizer_state_dict"])
                if start_epoch > 0:
                    if self.scheduler is not None and state.get("scheduler_state_dict") is not None:
                        self.scheduler.load_state_dict(state["scheduler_state_dict"])
                    self.scaler.load_state_dict(state.get("scaler_state_dict") or {})
            self._load_ema(settings.save_loc)
            log = os.path.join(settings.save_loc, "training_log.csv")
            if start_epoch > 0 and os.path.exists(log):
                saved = pd.read_csv(log)
                self.history = defaultdict(list, {k: list(saved[k]) for k in saved.columns if k != "index"})
            self.say(f"trainer.load_weights: weights from {path}; starting at epoch {start_epoch}")
        if settings.update_learning_rate:
            for group in self.optimizer.param_groups:
                group["lr"] = settings.learning_rate
        self.step = start_epoch * self._epoch_steps()
        if self.manager.dp_rank == 0:
            # CREDIT's fit fetches one batch on its rank 0 before training (trainers/preflight.py,
            # check_dataloader_startup): a DataLoader iterator, which draws its base seed from torch's default
            # generator. Drawn alike here, so that the dropout masks follow as CREDIT's do (--rng one-process).
            torch.empty((), dtype=torch.int64).random_()
        return start_epoch, epoch_step

    def _load_weights(self, state, path, strict=True):
        model = unwrapped(self.model)

        def load():
            ours, theirs = model.state_dict(), state["model_state_dict"]
            unexpected = [k for k in theirs if k not in ours]
            missing = [k for k in ours if k not in theirs]
            shapes = [k for k in ours if k in theirs and tuple(theirs[k].shape) != tuple(ours[k].shape)]
            if unexpected or shapes or (strict and missing):
                parts = [f"{len(unexpected)} unexpected weights (e.g. {unexpected[0]})" if unexpected else "",
                         f"{len(missing)} missing (e.g. {missing[0]})" if missing and strict else "",
                         f"{len(shapes)} of other shapes (e.g. {shapes[0]})" if shapes else ""]
                raise UsageError(f"{path}: the checkpoint holds another model ({'; '.join(p for p in parts if p)}); "
                                 "resume with the model block that saved it (a checkpoint of CREDIT's own "
                                 "domain-parallel trainer has renamed keys)")
            model.load_state_dict(theirs, strict=False)
        agreed(self.world, "credit train: loading the checkpoint's weights", load)

    def _load_ema(self, folder):
        """Load CREDIT's ``checkpoint_ema.pt`` from ``folder`` into the EMA where both exist."""
        if self.ema is None:
            return
        path = os.path.join(folder, "checkpoint_ema.pt")
        exists = self.world.bcast(os.path.exists(path) if self.rank == 0 else None, root=0)
        if exists:
            self.ema.load_state_dict(read_checkpoint(self.world, path, "the EMA weights")["model_state_dict"])

    def _resume(self, state, path):
        self._load_weights(state, path)
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        if self.scheduler is not None and state.get("scheduler_state_dict") is not None:
            self.scheduler.load_state_dict(state["scheduler_state_dict"])
        self.scaler.load_state_dict(state.get("scaler_state_dict") or {})
        extra = state.get("mpidomain")
        if not isinstance(extra, dict):  # CREDIT's own checkpoint.pt: the next epoch
            self._load_ema(os.path.dirname(os.path.abspath(path)))
            start = int(state["epoch"]) + 1
            self.step = start * self._epoch_steps()
            self.say(f"--resume: continuing from CREDIT's {path} (after epoch {state['epoch']}) at epoch {start}")
            return start, 0
        self.step = int(extra["step"])
        self.history = defaultdict(list, {k: list(v) for k, v in extra["history"].items()})
        self.epoch_results = defaultdict(list, {k: list(v) for k, v in extra["epoch_results"].items()})
        if self.ema is not None and extra.get("ema") is not None:
            self.ema.load_state_dict(extra["ema"])
        rng = extra.get("rng") or {}
        if extra.get("data_parallel") == self.manager.data_parallel_size and self.manager.dp_rank in rng:
            unpack_rng(rng[self.manager.dp_rank])
        if self.loss.parameters and extra.get("loss_parameters") is not None:
            with torch.no_grad():
                self.loss.parameters[0].copy_(extra["loss_parameters"])
        self.say(f"--resume: continuing from {path} (after step {self.step}, epoch {extra['epoch']} step "
                 f"{extra['epoch_step']})")
        return int(extra["epoch"]), int(extra["epoch_step"])

    # -- steps -----------------------------------------------------------------------------------------
    def _epoch_steps(self):
        n = -(-len(source_clock(self.train_plan.data)) // self.manager.data_parallel_size)
        batches = -(-n // self.settings.batch)
        configured = self.settings.batches_per_epoch
        return configured if 0 < configured < batches else batches

    def _non_finite(self, batch, step):
        """This rank's first non-finite value in a loader batch: a message naming variable, time and file."""
        source = self.settings.data.source
        meta = batch["metadata"][source]
        for part, stamp in (("input", "input_datetime"), ("target", "target_datetime")):
            for key, tensor in (batch.get(part) or {}).get(source, {}).items():
                finite = torch.isfinite(tensor.reshape(tensor.shape[0], -1)).all(dim=1)
                if not finite.all():
                    sample = int(torch.nonzero(~finite)[0])
                    when = pd.Timestamp(int(meta[stamp][sample]))
                    kind = key.split("/")[1]
                    try:
                        file = self.train_plan.index(kind).find(when) if kind != "static" else \
                            self.train_plan.index(kind).paths()[0]
                    except ValueError:
                        file = "?"
                    return f"step {step}: {key} at {when} in {file} is not finite (NaN or Inf) in this {part}"
        return None

    def _agree_finite(self, problem, what):
        """Every rank learns whether any rank found ``problem``; return the lowest rank's message or None."""
        if not agree(self.world, f"credit train: finite {what}", None, flag=problem is not None):
            return None
        return next(p for p in self.world.allgather(problem) if p is not None)

    def _step_input(self, t, batch, rollout, history_len):
        """The normalised ``(x, y)`` of rollout step ``t`` from loader ``batch``; ``rollout`` carries the first
        step's raw input, the previous prediction and the history window between steps."""
        source = self.settings.data.source
        targets = self._to_device(batch["target"][source]) if "target" in batch else None
        if t == 1:
            rollout["ic_raw"] = self._to_device(batch["input"][source])
            x, y = self.blocks.pre(rollout["ic_raw"], targets)
            rollout["history"] = x
            return x, y
        inputs = assemble_inputs(rollout["ic_raw"], rollout["prediction"], self._to_device(batch["input"][source]),
                                history_len)
        x, y = self.blocks.pre(inputs, targets)
        if history_len > 1:  # slide the window: drop the oldest time, append the newest
            x = torch.cat([rollout["history"][:, :, 1:], x[:, :, -1:]], dim=2)
            rollout["history"] = x
        return x, y

    def _members(self, x):
        """``x`` with each sample repeated ``trainer.ensemble_size`` times along the batch axis (CREDIT's
        ``repeat_interleave``); the members differ by their random draws only."""
        size = self.settings.ensemble_size
        return torch.repeat_interleave(x, size, 0) if size > 1 else x

    def _member_error_std(self, state):
        """CREDIT's ``train_std``: the standard deviation (unbiased) of every member's error over the whole field
        and batch. Collective over the domain group: two all-reduces of float64 partial sums."""
        pred, target = state["y_pred"].detach(), state["y"].detach()
        if pred.shape[0] == target.shape[0] * self.settings.ensemble_size:
            target = torch.repeat_interleave(target, self.settings.ensemble_size, 0)
        error = (pred - target.to(pred.dtype)).double()
        comm = library_comm(self.manager, "domain")
        count, total = reduce_array(np.array([error.numel(), float(error.sum())]), "sum", comm)
        mean = total / count
        squares = reduce_array(np.array([float(((error - mean) ** 2).sum())]), "sum", comm)[0]
        return float(np.sqrt(squares / max(count - 1, 1)))

    def _to_device(self, tensors):
        return {k: v.to(self.device, non_blocking=True) for k, v in tensors.items()}

    def _forward(self, x, y):
        with self.autocast():
            y_pred = self.model(x)
        if y_pred.dim() == 5:
            y_pred = y_pred.flatten(1, 2)
        return self.blocks.post({"y_pred": y_pred, "y": y})

    def train_step(self, batches, step):
        """One optimizer step's rollout on ``forecast_len`` loader batches; return its logs (this group's)."""
        settings, source = self.settings, self.settings.data.source
        logs, per_step, state, rollout, problem = defaultdict(float), {}, None, {}, None
        skip_nan = settings.skip_nan_prune or self.options.skip_nan
        for t in range(1, self.forecast_len + 1):
            batch = batches[t - 1]
            self.bytes_read += int(batch["metadata"][source]["bytes"].sum())
            message = self._agree_finite(self._non_finite(batch, step), "samples")
            if message is not None:
                if not skip_nan:
                    raise raised_alike(UsageError(f"{message}; clean the data, or set trainer.skip_nan_prune: true "
                                                  "(or --skip-nan) to skip such steps"))
                problem = message
                break
            x, y = self._step_input(t, batch, rollout, settings.data.history_len)
            state = self._forward(self._members(x), y)
            if t in settings.backprop_on_timestep:
                with self.autocast():
                    loss = self.loss(state)
                value = loss.item()
                logs["loss"] += value
                per_step[t] = value
                for key, var_loss in self.loss.last_var_losses.items():
                    logs[f"loss_var/{key}"] += var_loss
                if self.crps_ensemble:
                    logs["std"] += self._member_error_std(state)
                self.scaler.scale(loss / settings.grad_accum_every).backward()
            # detached for the next step's input only, after this step's loss and backward (CREDIT's intent)
            rollout["prediction"] = {k: v.detach() for k, v in state["y_processed"].items()}
        if problem is None and not math.isfinite(logs["loss"]):
            bad = [k for k, v in self.loss.last_var_losses.items() if not math.isfinite(v)]
            times = batches[0]["metadata"][source]["input_datetime"]
            problem = (f"step {step}: the loss is not finite ({logs['loss']}) for "
                       f"{', '.join(bad) or 'the summed variables'} with samples starting at "
                       f"{', '.join(str(pd.Timestamp(int(v))) for v in times)} on data-parallel group "
                       f"{self.manager.dp_rank}")
        problem = self._agree_finite(problem, "loss")
        return logs, per_step, state, problem

    def _sync_and_step(self):
        """The accumulation boundary: gradients of the whole field, averaged over the groups; clip; step."""
        settings, model = self.settings, self.model
        if self.manager.domain_parallel_size > 1:
            allreduce_gradients(model, group="domain", op="sum", manager=self.manager)
        if self.manager.data_parallel_size > 1:
            params = list(model.parameters()) + self.loss.parameters
            allreduce_gradients(params, group="data_parallel", op="mean", manager=self.manager)
        self.scaler.unscale_(self.optimizer)
        params = list(model.parameters())
        if settings.grad_max_norm == "dynamic":
            from credit.parallel.collectives import clip_grad_norm_

            # Every rank now holds the whole gradient of every parameter: the local norm counts each once.
            grads = [p.grad.detach() for p in params if p.grad is not None]
            norm = torch.stack([g.norm(2) for g in grads]).square().sum().sqrt() if grads else torch.tensor(0.0)
            clip_grad_norm_(params, max_norm=norm)
        elif settings.grad_max_norm > 0:
            from credit.parallel.collectives import clip_grad_norm_

            clip_grad_norm_(params, max_norm=settings.grad_max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        if self.ema is not None:
            self.ema.update(unwrapped(model))

    def _data_parallel_mean(self, values):
        if self.manager.data_parallel_size == 1:
            return values
        array = np.asarray(values, dtype=np.float64)
        return list(reduce_array(array, "mean", self.dp_comm))

    # -- epochs ----------------------------------------------------------------------------------------
    def train_epoch(self, epoch, first_step, loader, sampler, stop, steps_log):
        from credit.scheduler import update_on_batch

        settings = self.settings
        if settings.use_scheduler and settings.scheduler_type == "lambda" and first_step == 0:
            self.scheduler.step()
        steps = self._epoch_steps()
        sampler.set_epoch(epoch)
        sampler.skip = first_step * self.forecast_len
        self.model.train()
        results = getattr(self, "epoch_results", None) or defaultdict(list)
        self.epoch_results = None
        batches = iter(loader)
        for index in range(first_step, steps):
            began = time.perf_counter()
            boundary = (index + 1) % settings.grad_accum_every == 0 or index == steps - 1
            group = [next(batches) for _ in range(self.forecast_len)]
            logs, per_step, state, problem = self.train_step(group, self.step + 1)
            if problem is not None:
                if not (settings.skip_nan_prune or self.options.skip_nan):
                    raise raised_alike(RuntimeError(f"{problem}; set trainer.skip_nan_prune: true (or --skip-nan) "
                                                    "to skip such steps"))
                self.optimizer.zero_grad()
                self.skipped.append(self.step + 1)
                self.say(f"warning: skipping {problem}")
                logs = {"loss": math.nan}
            elif boundary:
                self._sync_and_step()
            metric_values = self.metrics(state) if problem is None and state is not None else {}
            keys = list(logs) + [f"metric:{k}" for k in metric_values] + [f"t{t}" for t in sorted(per_step)]
            means = self._data_parallel_mean([logs[k] for k in logs] + list(metric_values.values())
                                             + [per_step[t] for t in sorted(per_step)])
            averaged = dict(zip(keys, means))
            for name in metric_values:  # CREDIT's order: metrics, loss, per-variable losses, lengths
                results[f"train_{name}"].append(averaged[f"metric:{name}"])
            results["train_loss"].append(averaged.get("loss", math.nan))
            for key in logs:
                if key.startswith("loss_var/"):
                    results[f"train_{key}"].append(averaged[key])
            results["train_forecast_len"].append(self.forecast_len)
            results["train_history_len"].append(settings.data.history_len)
            if "std" in averaged:
                results["train_std"].append(averaged["std"])
            if settings.use_scheduler and settings.scheduler_type in update_on_batch:
                self.scheduler.step()
            self.step += 1
            self.step_seconds.append(time.perf_counter() - began)
            steps_log.append([self.step, averaged.get("loss", math.nan)] +
                             [averaged.get(f"t{t}", "") for t in range(1, self.forecast_len + 1)])
            if not np.isfinite(np.mean(results["train_loss"])) and not self.skipped:
                raise raised_alike(RuntimeError(f"step {self.step}: the epoch's mean loss is not finite"))
            if self.progress is not None:
                self.progress.update(1)
                self.progress.set_postfix_str(f"epoch {epoch} loss {np.mean(results['train_loss']):.4g}")
            done = index + 1
            every = self.options.checkpoint_every
            stopping = stop.requested()
            after = self.options.stop_after is not None and self.step >= self.options.stop_after
            if stopping or after or (every and self.step % every == 0 and done < steps):
                self.save_step(epoch, done, results, steps_log)
            if stopping:
                return results, stop.received
            if after:
                return results, f"--stop-after {self.options.stop_after}"
        return results, None

    def validate(self, epoch):
        settings = self.settings
        valid = settings.valid
        if getattr(self, "valid_loader", None) is None:
            self.valid_dataset = CreditTileDataset(self.valid_plan)
            self.valid_loader, _ = _loader(self.valid_dataset, settings.valid_batch, settings.data.forecast_len,
                                           settings, self.manager.data_parallel_size, self.manager.dp_rank, False,
                                           settings.valid_thread_workers)
        loader = self.valid_loader
        batches_available = len(loader)
        count = settings.valid_batches_per_epoch
        count = count if 0 < count < batches_available else batches_available
        results = defaultdict(list)
        self.model.eval()
        stream = _cycle(loader)
        with torch.no_grad():
            for _ in range(count):
                state, rollout, logs, metric_values = None, {}, {}, {}
                for t in range(1, valid.forecast_len + 1):
                    batch = next(stream)
                    x, y = self._step_input(t, batch, rollout, valid.history_len)
                    state = self._forward(self._members(x), y)
                    rollout["prediction"] = state["y_processed"]
                    if t == valid.forecast_len:
                        loss = self.valid_loss(state)
                        logs["loss"] = loss.item()
                        for key, value in self.valid_loss.last_var_losses.items():
                            logs[f"loss_var/{key}"] = value
                        metric_values = self.metrics(state)
                keys = list(logs) + [f"metric:{k}" for k in metric_values]
                means = dict(zip(keys, self._data_parallel_mean([logs[k] for k in logs]
                                                               + list(metric_values.values()))))
                for key in logs:
                    if key.startswith("loss_var/"):
                        results[f"valid_{key}"].append(means[key])
                for name in metric_values:
                    results[f"valid_{name}"].append(means[f"metric:{name}"])
                results["valid_loss"].append(means["loss"])
                results["valid_forecast_len"].append(valid.forecast_len)
                results["valid_history_len"].append(valid.history_len)
        return results

    # -- saving ----------------------------------------------------------------------------------------
    def _state(self, epoch, epoch_step, results):
        """CREDIT's checkpoint keys plus the ``mpidomain`` entry (collective: gathers each group's RNG)."""
        rng = self.world.allgather((self.manager.dp_rank, self.manager.domain_rank, pack_rng()))
        per_group = {dp: state for dp, domain_rank, state in rng if domain_rank == 0}
        model = unwrapped(self.model)
        extra = {"format": FORMAT, "step": self.step, "epoch": epoch, "epoch_step": epoch_step,
                 "epoch_results": {k: list(v) for k, v in (results or {}).items()},
                 "history": {k: list(v) for k, v in self.history.items()},
                 "rng": per_group, "data_parallel": self.manager.data_parallel_size,
                 "domain": list(self.settings.domain), "ema": self.ema.state_dict() if self.ema is not None else None,
                 "loss_parameters": self.loss.parameters[0].detach().cpu() if self.loss.parameters else None}
        return {"epoch": epoch - 1, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": self.optimizer.state_dict(),
                "scheduler_state_dict": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler_state_dict": self.scaler.state_dict(), "mpidomain": extra}

    def save_step(self, epoch, epoch_step, results, steps_log):
        """A numbered checkpoint after the current step, ``epoch_step`` steps into ``epoch`` (after its last step,
        a resume runs the epoch's end: validation, logs, ``checkpoint.pt``)."""
        state = self._state(epoch, epoch_step, results)
        self._flush_steps(steps_log)  # before the save's collective: when it returns, every rank sees the rows
        path = step_folder(self.settings.save_loc, self.options.keep).save(self.world, state, self.step)
        self.say(f"checkpoint after step {self.step}: {path}")
        return path

    def _flush_steps(self, rows):
        if self.rank != 0 or not rows:
            return
        path = os.path.join(self.settings.save_loc, "training_steps.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as file:
            writer = csv.writer(file)
            if new:
                writer.writerow(["step", "train_loss"] + [f"loss_t{t}" for t in range(1, self.forecast_len + 1)])
            writer.writerows(rows)
        rows.clear()

    def trim_steps_log(self):
        """Keep the rows of ``training_steps.csv`` up to the resumed step (a run resumed from an older point)."""
        path = os.path.join(self.settings.save_loc, "training_steps.csv")
        if self.rank != 0:
            return
        if self.step == 0 or not os.path.exists(path):
            if os.path.exists(path):
                os.remove(path)
            return
        with open(path, newline="") as file:
            rows = list(csv.reader(file))
        kept = [rows[0]] + [r for r in rows[1:] if r and int(r[0]) <= self.step]
        with open(path, "w", newline="") as file:
            csv.writer(file).writerows(kept)

    def write_log(self):
        if self.rank != 0:
            return
        longest = max(len(v) for v in self.history.values())
        padded = OrderedDict((k, [np.nan] * (longest - len(v)) + list(v)) for k, v in self.history.items())
        frame = pd.DataFrame.from_dict(padded).reset_index()
        frame = frame[[c for c in _COLUMN_ORDER if c in frame.columns] +
                      [c for c in frame.columns if c not in _COLUMN_ORDER]]
        frame.to_csv(os.path.join(self.settings.save_loc, "training_log.csv"), index=False)

    def display_metrics(self):
        metrics = self.settings.conf.get("metrics") or {}
        if metrics.get("type") == "combined":
            return tuple((metrics.get("args") or {}).get("metrics") or {})
        return DEFAULT_DISPLAY_METRICS

    def log_names(self, train_results, valid_results):
        """CREDIT's choice of training_log.csv columns (``trainer.save_metric_vars``)."""
        required = ["loss", *self.display_metrics(), "forecast_len", "history_len"]
        every = list(dict.fromkeys(key.removeprefix(prefix) for prefix, results in
                                   (("train_", train_results), ("valid_", valid_results))
                                   for key in results if key.startswith(prefix)))
        chosen = self.settings.save_metric_vars
        if isinstance(chosen, list):
            names = [n for n in every if any(v in n for v in chosen)] if chosen else []
        else:
            names = every if chosen else []
        return list(dict.fromkeys(names + required))


def _scheduler(load_scheduler, optimizer, conf):
    try:
        return load_scheduler(optimizer, conf)
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"trainer.scheduler = {conf['trainer'].get('scheduler')!r}: CREDIT's load_scheduler "
                         f"refused it ({type(error).__name__}: {error})") from None


def _tensorboard(run):
    if not run.settings.use_tensorboard or run.rank != 0:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        run.say("warning: trainer.use_tensorboard is true but tensorboard is not installed (pip install "
                "tensorboard); no TensorBoard logs")
        return None
    return SummaryWriter(log_dir=os.path.join(run.settings.save_loc, "tensorboard"))


def train(settings, options, manager, say=print):
    """Train the config of ``settings`` on ``manager``'s layout; return a summary dict.

    Collective over every rank of the job (the manager's world): call on every rank with the same settings and
    options. Problems with the config, the data or a checkpoint raise :class:`UsageError` alike on every rank
    before any step; a non-finite sample or loss stops the run alike on every rank (or skips the step); a stop
    signal ends the run after the current step with a numbered checkpoint.
    """
    from credit.scheduler import update_on_epoch

    conf, post_conf_active = training_conf(settings.conf)  # CREDIT's train_gen2 steps before its loss and model
    settings = replace(settings, conf=conf)
    run = _Run(settings, options, manager, lambda line: say(line) if manager.rank == 0 else None)
    if post_conf_active:
        run.say("model.post_conf is not applied in training (as CREDIT's train_gen2)")
    run.prepare()
    start_epoch, first_step = run.restore()
    run.trim_steps_log()
    epochs = settings.epochs
    if settings.train_one_epoch:  # CREDIT: one more epoch after those in the log
        if run.history.get("epoch"):
            start_epoch = len(run.history["epoch"])
        epochs = start_epoch + 1
    limit = min(epochs, start_epoch + settings.num_epoch)
    dataset = CreditTileDataset(run.train_plan)
    # An ensemble (CREDIT's ensemble mode) gives every data-parallel group the same batches: the groups' draws
    # (seeded seed + group) make more members.
    replicas, replica = (1, 0) if run.crps_ensemble else (manager.data_parallel_size, manager.dp_rank)
    loader, sampler = _loader(dataset, settings.batch, run.forecast_len, settings, replicas, replica, True,
                              settings.thread_workers)
    files = EpochFiles(run.world, settings.save_loc)
    writer = _tensorboard(run)
    steps_log = []
    run.progress = None
    if options.progress and run.rank == 0:
        try:
            from tqdm import tqdm

            run.progress = tqdm(total=(limit - start_epoch) * run._epoch_steps(), initial=first_step, unit="step",
                                desc="credit train", dynamic_ncols=True)
        except ImportError:
            run.progress = None
    stopped = None
    began = time.perf_counter()
    with StopSignals(run.world, options.stop_signals) as stop:
        for epoch in range(start_epoch, limit):
            if epoch > start_epoch and settings.save_backup_weights:
                files.backup()
            train_results, stopped = run.train_epoch(epoch, first_step if epoch == start_epoch else 0, loader,
                                                     sampler, stop, steps_log)
            if stopped:
                break
            if settings.skip_validation:
                valid_results = train_results
            else:
                if run.ema is not None:
                    run.ema.swap(unwrapped(run.model))
                valid_results = run.validate(epoch)
                if run.ema is not None:
                    run.ema.swap(unwrapped(run.model))
            run.history["epoch"].append(epoch)
            for name in run.log_names(train_results, valid_results):
                if f"train_{name}" in train_results:
                    run.history[f"train_{name}"].append(float(np.mean(train_results[f"train_{name}"])))
                if not settings.skip_validation and f"valid_{name}" in valid_results:
                    run.history[f"valid_{name}"].append(float(np.mean(valid_results[f"valid_{name}"])))
            run.history["lr"].append(run.optimizer.param_groups[0]["lr"])
            if settings.use_scheduler and settings.scheduler_type in update_on_epoch:
                if settings.scheduler_type == "plateau":
                    run.scheduler.step(run.history[settings.training_metric][-1])
                else:
                    run.scheduler.step()
            run.write_log()
            if writer is not None:
                for key, values in run.history.items():
                    if key != "epoch" and values and np.isfinite(values[-1]):
                        tag = f"{key.split('_', 1)[1]}/{key.split('_', 1)[0]}" if key.startswith(
                            ("train_", "valid_")) else f"train/{key}"
                        writer.add_scalar(tag, values[-1], epoch)
                writer.flush()
            state = run._state(epoch + 1, 0, None)
            run._flush_steps(steps_log)  # before the save's collective: when it returns, every rank sees the rows
            files.save(state, run.ema.state_dict() if run.ema is not None else None, epoch, settings.save_every_epoch)
            say_epoch = (f"epoch {epoch}: train_loss {run.history['train_loss'][-1]:.6g}"
                         + (f", valid_loss {run.history['valid_loss'][-1]:.6g}" if "valid_loss" in run.history
                            and not settings.skip_validation else "")
                         + f"; checkpoint {files.path}")
            run.say(say_epoch)
            if not settings.skip_validation and settings.training_metric in run.history:
                history = run.history[settings.training_metric]
                best = (min if settings.direction == "min" else max)(history)
                offset = epoch - run.history["epoch"][history.index(best)]
                if offset == 0 and settings.save_best_weights:
                    files.best()
                if offset >= settings.stopping_patience:
                    run.say(f"early stopping: best {settings.training_metric} at epoch {epoch - offset}")
                    break
            if settings.stop_after_epoch:
                break
    if run.progress is not None:
        run.progress.close()
    if writer is not None:
        writer.close()
    dataset.close()
    return {"run": run, "stopped": stopped, "seconds": time.perf_counter() - began}

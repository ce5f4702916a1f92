"""The whole job, from disk to disk: :func:`run_forecast`.

Every rank reads only its tile of the store, trains the domain-parallel model on its
group's samples, rolls forecasts out on its tile and writes its tile of the forecast;
no rank ever holds the whole field (but for the picture, which draws one field).

Long runs survive their end: numbered checkpoints (every ``checkpoint_every``
steps, the newest ``keep`` kept, each written whole or not at all), a clean stop
at the next step (or forecast lead) on the scheduler's signal, ``resume="auto"``
from the newest complete checkpoint, and a forecast store that holds only whole
steps after a kill and is completed by the resumed run.
"""

import hashlib
import math
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import torch
import xarray as xr
import zarr
from zarr.storage import LocalStore

from .._agreement import agree
from .._errors import describe_error
from .._mpi import mpi
from .._waits import barrier
from ..checkpoints import CheckpointFolder, restore_rng_states, rng_states
from ..command import UsageError, agreed, require, world
from ..data import CountingStore, TileDataset, select_tile, write_tile
from ..manager import initialize_domain_parallel, library_comm
from ..models import (UNet, convert_model, credit_crossformer, credit_missing, custom_converters,
                      unet_grid_problem)
from ..nn import (LatitudeWeightedMSE, TrainingOptions, allreduce_gradients, estimate_memory, latitude_weighted_rmse,
                  prepare_training)
from ..preemption import StopSignals
from ..reduce import allreduce
from .outputs import prepare_outputs
from .progress import progress
from .settings import requirements
from .synthetic import synthetic_layout, write_synthetic_store

__all__ = ["run_forecast", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "mpidomain-forecast-2"
_READABLE_FORMATS = ("mpidomain-forecast-1", CHECKPOINT_FORMAT)
_CHECKPOINT_KEYS = ("step", "model_name", "channels", "grid", "dtype", "statistics", "losses", "model", "optimizer")
_SAMPLE_SETTINGS = ("seed", "batch", "train_rollout")  # what the samples each step draws follow
LAT, LON, TIME, LEVEL = "latitude", "longitude", "time", "level"
_GRID_DIMS = ({TIME, LAT, LON}, {TIME, LEVEL, LAT, LON})  # the dims of a variable the job can model


def _settings_differ(descriptions):
    fields = [k for k in descriptions[0] if any(d[k] != descriptions[0][k] for d in descriptions)]
    listing = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {d[k]}" for r, d in enumerate(descriptions)) for k in fields)
    return UsageError(f"the forecast's settings must be the same on every rank, but they differ in {listing}; "
                      "call run_forecast with the same settings on every rank")


def _digest(state_dict):
    """A digest of a model's weights: the same on every rank holding the same weights."""
    hashed = hashlib.blake2b(digest_size=12)
    for name, tensor in state_dict.items():
        hashed.update(name.encode())
        hashed.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hashed.hexdigest()


class _Stopped(Exception):
    """A stop signal settled at a boundary: the job ends with exit status 0 and this line."""


class _Job:
    """One run's state: the manager, the data, the model, what was measured."""

    def __init__(self, settings, out, plain_progress):
        self.settings, self.print, self.plain_progress = settings, out, plain_progress
        comm = world()
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        problems = settings.problems(self.size)
        agree(comm, "forecast: the settings", {k: repr(v) for k, v in vars(settings).items()},
              error=UsageError("; ".join(problems)) if problems else None, mismatch=_settings_differ)
        self.shape = settings.domain_shape(self.size)
        tiles = len(self.shape) == 2
        self.manager = initialize_domain_parallel(self.size, self.shape if tiles else self.shape[0],
                                                  (-2, -1) if tiles else -2)
        self.world = library_comm(self.manager, "world")
        # The ranks of a node share its cores: torch's threads per rank, so that no core is oversubscribed.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.manager.local_size))
        self.dtype = torch.float64 if settings.dtype == "float64" else torch.float32
        self.losses, self.step_seconds, self.skipped = [], [], []
        self.written, self.store, self.resumed_from, self.model = 0, None, None, settings.model
        if settings.out is None:
            self.folder = self.world.bcast(tempfile.mkdtemp(prefix="mpidomain-forecast-") if self.rank == 0 else None)
        else:
            self.folder = os.path.abspath(settings.out)
        self.checkpoints = CheckpointFolder(self.folder, "checkpoint", keep=settings.keep, latest="checkpoint.pt")

    def say(self, line):
        """Print ``line`` once (world rank 0)."""
        if self.rank == 0:
            self.print(line)

    def progress(self, total, what, initial=0):
        return progress(self.rank == 0, self.plain_progress, total, what, initial)

    # -- the data, described before any is read or written -------------------------------------------------
    def describe_data(self):
        """The variables, their channels' layout and the grid, from the store's metadata or (synthetic data) its
        definition; checked on every rank."""
        settings = self.settings
        if settings.data is None:
            self.data_path = os.path.join(self.folder, "era5-synthetic.zarr")
            self.layout = agreed(self.world, "forecast: --variables", lambda: synthetic_layout(settings.variables))
            self.grid = tuple(settings.grid)
            self.variables = [name for name, _ in self.layout]
            return
        self.data_path = settings.data

        def open_store():
            if not os.path.isdir(settings.data):
                raise UsageError(f"--data {settings.data}: no such Zarr store (a folder); give an existing store, "
                                 "or leave --data out for a synthetic one")
            store = CountingStore(LocalStore(settings.data, read_only=True))
            try:
                return store, xr.open_zarr(store, consolidated=False, chunks=None)
            except Exception as error:  # noqa: BLE001 - whatever zarr or xarray make of a folder that is no store
                raise UsageError(f"--data {settings.data}: not a Zarr store xarray can open "
                                 f"({describe_error(error, 200)})") from None

        self.store, self.data = agreed(self.world, "forecast: opening --data", open_store)
        self.variables = agreed(self.world, "forecast: --variables", self._variables)
        self.layout = [(v, self.data.sizes[LEVEL]) for v in self.variables if LEVEL in self.data[v].dims]
        self.layout += [(v, None) for v in self.variables if LEVEL not in self.data[v].dims]
        self.grid = (self.data.sizes[LAT], self.data.sizes[LON])
        times, need = self.data.sizes[TIME], settings.rollout + settings.train_rollout + 2
        if times < need:
            raise UsageError(f"--data {settings.data}: {times} time steps, but training on {settings.train_rollout}-step "
                             f"rollouts and a {settings.rollout}-step forecast need at least {need}; use a longer "
                             "store or smaller --rollout / --train-rollout")

    def _variables(self):
        data, path = self.data, self.data_path
        if TIME not in data.dims or LAT not in data.dims or LON not in data.dims:
            raise UsageError(f"--data {path}: the store's dims are {list(data.dims)}; the forecast needs "
                             f"({TIME}, [{LEVEL},] {LAT}, {LON}) variables")
        names = list(self.settings.variables) if self.settings.variables else sorted(  # the store lists in any order
            v for v in data.data_vars if set(data[v].dims) in _GRID_DIMS)
        missing = [v for v in names if v not in data.data_vars]
        if missing:
            raise UsageError(f"--variables {','.join(names)}: {missing} not in the store, whose variables are "
                             f"{list(data.data_vars)}")
        wrong = {v: data[v].dims for v in names if set(data[v].dims) not in _GRID_DIMS}
        if wrong:
            listing = ", ".join(f"{v} {tuple(dims)}" for v, dims in wrong.items())
            raise UsageError(f"--variables: {listing} must have the dims ({TIME}, {LAT}, {LON}) or ({TIME}, {LEVEL}, "
                             f"{LAT}, {LON}); choose variables on that grid (select a member first, e.g. with xarray)")
        if not names:
            raise UsageError(f"--data {path}: no variable has the dims ({TIME}, {LAT}, {LON}) or ({TIME}, {LEVEL}, "
                             f"{LAT}, {LON}); its variables are "
                             f"{', '.join(f'{v} {tuple(data[v].dims)}' for v in data.data_vars)}")
        return names

    def open_data(self):
        """Write the synthetic store (if no ``--data``), open the data by tile, and check the forecast's initial
        state is finite on every rank."""
        settings = self.settings
        if settings.data is None:
            if self.rank == 0:
                shutil.rmtree(self.data_path, ignore_errors=True)
            barrier(self.world, "the synthetic store")
            write_synthetic_store(self.data_path, self.manager, settings.grid, settings.times, settings.seed)
            self.store = CountingStore(LocalStore(self.data_path, read_only=True))
            self.data = xr.open_zarr(self.store, consolidated=False, chunks=None)
        self.init_time = self.data.sizes[TIME] - settings.rollout - 1  # the forecast starts here; training before
        self.raw = TileDataset(self.data, self.variables, manager=self.manager, dtype=torch.float64)
        self.channels = self.raw.channels
        tile = select_tile(self.data[self.variables[:1]], self.manager)  # lazy: its coordinates alone are read
        self.latitude, self.longitude = tile[LAT].values, tile[LON].values
        problem = self._sample_problem([self.raw[self.init_time]], [self.init_time])
        message = self._not_finite(None, "initial state", problem)
        if message is not None:
            raise UsageError(f"the forecast's initial state: {message}; clean the data")

    def statistics(self):
        """Per-variable mean and standard deviation over the training times' finite values (by tile, summed over
        the group): a NaN in the data is found by the step that draws it, not spread into every sample."""
        tile = select_tile(self.data[self.variables], self.manager)
        sums = []
        for name, levels in self.layout:
            values = tile[name].isel({TIME: slice(0, self.init_time)}).values.astype(np.float64)
            axes = tuple(i for i, d in enumerate(tile[name].dims) if d != LEVEL)
            finite = np.isfinite(values)
            values = np.where(finite, values, 0.0)
            sums += [values.sum(axis=axes).ravel(), np.square(values).sum(axis=axes).ravel(),
                     finite.sum(axis=axes).ravel().astype(np.float64)]
        flat = np.concatenate(sums)
        total = np.empty_like(flat)
        library_comm(self.manager, "domain").Allreduce(flat, total)
        mean, std, at = {}, {}, 0
        for name, levels in self.layout:
            s, q, count = (total[at + i * (levels or 1):at + (i + 1) * (levels or 1)] for i in range(3))
            at += 3 * (levels or 1)
            if not count.all():
                raise UsageError(f"--data {self.data_path}: {name} has no finite value in the training times; "
                                 "clean the data or leave the variable out (--variables)")
            m = s / count
            spread = np.sqrt(np.maximum(q / count - m * m, 0.0))
            spread[spread == 0] = 1.0
            mean[name], std[name] = (m, spread) if levels else (float(m[0]), float(spread[0]))
        return mean, std

    def samples(self, statistics):
        mean, std = statistics
        self.dataset = TileDataset(self.data, self.variables, manager=self.manager, mean=mean, std=std,
                                   dtype=self.dtype)
        per_channel = [[], []]
        for name, levels in self.layout:
            for i, statistic in enumerate((mean, std)):
                per_channel[i] += list(np.broadcast_to(statistic[name], (levels or 1,)))
        self.scale = tuple(torch.tensor(values, dtype=torch.float64)[:, None, None] for values in per_channel)

    # -- the model -----------------------------------------------------------------------------------
    def model_name(self):
        if self.settings.model != "auto":
            return self.settings.model
        reasons = self.world.allgather(credit_missing())
        return "cnn" if any(reasons) else "crossformer"

    def _where(self):
        grid = f"{self.grid[0]}x{self.grid[1]}"
        data = f"--grid {grid}" if self.settings.data is None else f"--data {self.settings.data} ({grid})"
        return f"{data} with -D {self.settings.domain_text(self.size)}"

    def single_model(self, name):
        """The model on one process's terms, seeded (the same weights on every rank and at every layout)."""
        torch.manual_seed(self.settings.seed)
        height, width = self.grid
        upper = [v for v, levels in self.layout if levels]
        if name == "crossformer":
            levels = max((levels or 0 for _, levels in self.layout), default=0)
            # Windows that keep the groups of rows and columns small (16: four stride-2 stages, windows <= 1 at the
            # last two), so that the default grid splits into 4 slabs or 2 x 2 tiles.
            model = credit_crossformer(len(upper), levels, len(self.layout) - len(upper), height, width,
                                       local_window_size=1, global_window_size=(2, 2, 1, 1))
        else:
            channels = sum(levels or 1 for _, levels in self.layout)
            model = UNet(channels, width=16)
        return model.to(self.dtype)

    def build_model(self, name):
        """The model, seeded, converted to domain-parallel; a grid or layout it cannot run on is one line."""
        if name == "cnn":
            tiles = self.shape if len(self.shape) == 2 else (self.shape[0], 1)
            problem = unet_grid_problem(*self.grid, tiles)
            if problem:
                raise UsageError(f"{self._where()}: {problem}")

        def build():
            try:
                return convert_model(self.single_model(name), self.manager, self.settings.rng)
            except ValueError as error:
                raise UsageError(f"--model {name} on {self._where()}: {error}") from None
        return agreed(self.world, f"forecast: building the {name} model", build)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _check_format(self, state, path):
        """Raise UsageError unless ``state`` is a checkpoint of this command."""
        if not isinstance(state, dict) or state.get("format") not in _READABLE_FORMATS:
            raise UsageError(f"--resume {path}: not a checkpoint of python -m mpidomain forecast; give one a forecast "
                             "run saved, or --resume auto")
        lacking = [key for key in _CHECKPOINT_KEYS if key not in state]
        if lacking:
            raise UsageError(f"--resume {path}: a forecast checkpoint without {', '.join(lacking)} (written by another "
                             "version, or damaged); give a complete one, or --resume auto")

    def _check_fits(self, state, path, name):
        """Raise UsageError unless the checkpoint ``state`` continues this run."""
        for what, theirs, ours in (("channels", len(state["channels"]), sum(levels or 1 for _, levels in self.layout)),
                                   ("grid", tuple(state["grid"]), self.grid),
                                   ("--dtype", state["dtype"], self.settings.dtype),
                                   ("--model", state["model_name"], name)):
            if theirs != ours:
                raise UsageError(f"--resume {path}: the checkpoint's {what} is {theirs}, this run's is {ours}; "
                                 "resume with the settings that saved it")
        for key in _SAMPLE_SETTINGS:
            theirs = state.get("settings", {}).get(key, getattr(self.settings, key))
            if theirs != getattr(self.settings, key):
                option = f"--{key.replace('_', '-')}"
                raise UsageError(f"--resume {path}: the checkpoint's run used {option} {theirs}, this run "
                                 f"{getattr(self.settings, key)}; resume with {option} {theirs} (the samples each step "
                                 "draws follow it)")
        last = self.settings.stop_after or self.settings.steps
        if state["step"] > last:
            option = "--stop-after" if self.settings.stop_after else "--steps"
            raise UsageError(f"--resume {path}: the checkpoint is after step {state['step']}, past {option} {last}; "
                             f"raise {option} to train on, or resume an earlier checkpoint")

    def resume_state(self, name):
        """The state to resume from (``--resume PATH`` or ``auto``), checked on every rank; None to start fresh."""
        settings = self.settings
        if not settings.resume:
            return None
        if settings.resume == "auto":
            path, state, skipped = self.checkpoints.newest(self.world,
                                                           check=lambda state: self._check_format(state, "auto"))
            for skipped_path, reason in skipped:
                self.say(f"warning: --resume auto skips {skipped_path}: {reason}")
            if path is None:
                self.say(f"--resume auto: no complete checkpoint in {self.folder}; starting fresh")
                return None
            agreed(self.world, "forecast: --resume auto", lambda: self._check_fits(state, path, name))
            self.say(f"--resume auto: continuing from {path} (after step {state['step']})")
            self.resumed_from = path
            return state
        path = settings.resume

        def read():
            if os.path.isdir(path):
                raise UsageError(f"--resume {path}: a folder; give a checkpoint file, or --resume auto with --out "
                                 f"{path}")
            if not os.path.isfile(path):
                raise UsageError(f"--resume {path}: no such file; give a checkpoint a forecast run saved, or "
                                 "--resume auto")
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as error:  # noqa: BLE001 - a corrupt, empty or foreign file
                raise UsageError(f"--resume {path}: not a readable checkpoint ({describe_error(error, 160)}); "
                                 "give a checkpoint a forecast run saved, or --resume auto") from None
            self._check_format(state, path)
            self._check_fits(state, path, name)
            return state
        state = agreed(self.world, "forecast: --resume", read)
        self.resumed_from = path
        return state

    def load_weights(self, model, state, path):
        """Load ``state``'s weights into ``model``; a checkpoint of another model is one line, on every rank."""
        def load():
            try:
                model.load_state_dict(state["model"])
            except RuntimeError as error:
                ours, theirs = model.state_dict(), state["model"]
                missing = [k for k in ours if k not in theirs]
                extra = [k for k in theirs if k not in ours]
                shapes = [f"{k} {tuple(theirs[k].shape)} (this model: {tuple(ours[k].shape)})" for k in ours
                          if k in theirs and tuple(theirs[k].shape) != tuple(ours[k].shape)]
                parts = [f"{len(missing)} weights missing (e.g. {missing[0]})" if missing else "",
                         f"{len(extra)} unexpected (e.g. {extra[0]})" if extra else "",
                         f"{len(shapes)} of other shapes (e.g. {shapes[0]})" if shapes else ""]
                raise UsageError(f"--resume {path}: the checkpoint holds another model: "
                                 f"{'; '.join(p for p in parts if p) or describe_error(error)}; resume with the "
                                 "--model, --variables and data that saved it") from None
        agreed(self.world, "forecast: loading the checkpoint's weights", load)

    def restore(self, model, optimizer, state):
        """Continue from ``state``: weights, optimizer (at this run's --lr), losses, every rank's generators."""
        if tuple(state["channels"]) != tuple(self.channels):
            raise UsageError(f"--resume {self.resumed_from}: the checkpoint's channels are {tuple(state['channels'])}, "
                             f"this run's are {tuple(self.channels)}; resume with the --variables and data that saved it")
        self.load_weights(model, state, self.resumed_from)
        optimizer.load_state_dict(state["optimizer"])
        for group in optimizer.param_groups:
            if group["lr"] != self.settings.lr:
                self.say(f"--lr {self.settings.lr}: the checkpoint's run used {group['lr']}; training goes on at "
                         f"{self.settings.lr}")
            group["lr"] = self.settings.lr
        rng = state.get("rng")
        if isinstance(rng, dict):  # a format-1 checkpoint: one rank's generators
            restore_rng_states(rng)
        elif rng:  # every rank's, by world rank; at another number of ranks, rank 0's
            restore_rng_states(rng[self.rank] if len(rng) == self.size else rng[0])
        self.losses = list(state["losses"])
        return state["step"] + 1

    def save(self, model, optimizer, step, name, statistics):
        """Save the checkpoint after ``step`` (numbered, the newest ``keep`` kept; ``checkpoint.pt`` the newest)."""
        rng = self.world.allgather(rng_states())  # every rank's generators, by world rank
        state = {"format": CHECKPOINT_FORMAT, "step": step, "model_name": name, "channels": self.channels,
                 "grid": self.grid, "dtype": self.settings.dtype, "statistics": statistics, "losses": list(self.losses),
                 "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng,
                 "settings": {k: getattr(self.settings, k) for k in ("steps", "lr") + _SAMPLE_SETTINGS}}
        return self.checkpoints.save(self.world, state, step)

    # -- training ------------------------------------------------------------------------------------
    def starts(self, step, rollout):
        """The initial times of ``step``'s samples for this domain group (the same draw on every rank)."""
        rng = np.random.default_rng([self.settings.seed, step])
        drawn = rng.integers(0, self.init_time - rollout, size=self.settings.batch)
        per_group = self.settings.batch // self.manager.data_parallel_size
        return [int(t) for t in drawn[self.manager.dp_rank * per_group:(self.manager.dp_rank + 1) * per_group]]

    def rollout_of(self, step):
        """Steps of the rollout training step ``step`` backpropagates through: 1, then the last third fine-tunes."""
        steps = self.settings.steps
        return 1 if step <= steps - steps // 3 else self.settings.train_rollout

    def _not_finite(self, step, what, problem):
        """Settle over every rank whether ``problem`` (this rank's, or None) spoils ``step``; return the message
        (the lowest failing rank's) or None, the same on every rank."""
        if not agree(self.world, f"forecast: finite {what}", None, flag=problem is not None):
            return None
        found = [p for p in self.world.allgather(problem) if p is not None]
        return found[0] if step is None else f"step {step}: {found[0]}"

    def _sample_problem(self, tiles, times):
        """This rank's first non-finite value among ``tiles`` (per sample, channel) at ``times``: a message, or None."""
        for tile, t in zip(tiles, times):
            bad = ~torch.isfinite(tile.reshape(tile.shape[0], -1)).all(dim=1)
            if bad.any():
                channel = self.channels[int(torch.nonzero(bad)[0])]
                when = str(self.data[TIME].values[t])[:19]
                return (f"{channel} at time {when} (index {t}) of --data {self.data_path} is not finite (NaN or "
                        "Inf)")
        return None

    def train_step(self, setup, optimizer, loss_function, step):
        """One optimizer step of ``setup`` (:class:`~mpidomain.nn.TrainingSetup`); return its loss (the mean over
        the data-parallel groups), or None if skipped."""
        model = setup.model
        rollout = self.rollout_of(step)
        starts = self.starts(step, rollout)
        inputs = [self.dataset[t] for t in starts]
        targets = [[self.dataset[t + k] for t in starts] for k in range(1, rollout + 1)]
        problem = self._sample_problem(inputs + [y for ys in targets for y in ys],
                                       starts + [t + k for k in range(1, rollout + 1) for t in starts])
        message = self._not_finite(step, "samples", problem)
        if message is not None:
            if not self.settings.skip_nan:
                raise UsageError(f"{message}; clean the data, or pass --skip-nan to skip such steps")
            self.say(f"skipped {message}")
            self.skipped.append(step)
            return None
        optimizer.zero_grad(set_to_none=True)
        x, total = torch.stack(inputs), 0
        with setup.autocast():
            for k in range(1, rollout + 1):
                x = model(x)
                total = total + loss_function(x, torch.stack(targets[k - 1]))
            loss = total / rollout
        value = float(loss.detach())
        message = self._not_finite(step, "loss", None if math.isfinite(value) else
                                   f"the loss is not finite ({value}) on data-parallel group {self.manager.dp_rank}, "
                                   "from finite samples")
        if message is not None:  # the weights made it: skipping the step would leave them so (--skip-nan or not)
            raise UsageError(f"{message}: the model diverged; lower --lr")
        setup.backward(loss)
        allreduce_gradients(model, group="domain", op="sum", manager=self.manager)
        allreduce_gradients(model, group="data_parallel", op="mean", manager=self.manager)
        setup.step(optimizer)
        weights = next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None)
        message = self._not_finite(step, "weights", None if weights is None else
                                   f"the weights ({weights}) are not finite after the optimizer step")
        if message is not None:  # no step can be skipped past this: every later one would start from them
            raise UsageError(f"{message}; lower --lr")
        return float(allreduce(loss.detach().double(), "mean", "data_parallel", self.manager))

    def train(self, model, optimizer, name, statistics, first, stop):
        """Train from step ``first`` to the last; checkpoint periodically and at the end; raise :class:`_Stopped`
        when a stop signal is settled at a step boundary. Return the path of the checkpoint of the last step.

        ``model`` trains through what ``--compile``, ``--activation-checkpoint`` and ``--amp`` switch on
        (:func:`~mpidomain.nn.prepare_training`); its own state_dict is what the checkpoints hold."""
        settings = self.settings
        setup = prepare_training(model, self.training_options(), manager=self.manager)
        loss_function = LatitudeWeightedMSE(self.latitude, self.manager)
        last = settings.stop_after or settings.steps
        model.train()
        if stop.requested():
            raise _Stopped(f"stopped by {stop.received} before training: nothing trained, nothing saved")
        path = None
        with self.progress(last, "train", initial=first - 1) as bar:
            for step in range(first, last + 1):
                began = time.perf_counter()
                loss = self.train_step(setup, optimizer, loss_function, step)
                self.losses.append(math.nan if loss is None else loss)
                self.step_seconds.append(self.world.allreduce(time.perf_counter() - began, op=mpi().MAX))
                bar.set_postfix_str(f"loss {self.losses[-1]:.4g}, rollout {self.rollout_of(step)}")
                bar.update(1)
                stopping = stop.requested()
                if stopping or step == last or (settings.checkpoint_every and step % settings.checkpoint_every == 0):
                    path = self.save(model, optimizer, step, name, statistics)
                    if stopping:
                        raise _Stopped(f"stopped by {stop.received} after step {step}: checkpoint {path}; continue "
                                       f"with the same command and --resume auto (--out {self.folder})")
        if path is None:  # nothing to train: the resumed state becomes this run's newest checkpoint
            self.say(f"nothing to train: the checkpoint is after step {first - 1} of {last}")
            path = self.save(model, optimizer, first - 1, name, statistics)
        return path

    def training_options(self, forecast=False):
        """What the command line switches on (:class:`~mpidomain.nn.TrainingOptions`); the forecast only compiles
        (no backward to checkpoint for, written in the model's dtype)."""
        settings = self.settings
        if forecast:
            return TrainingOptions(compile=settings.compile, compile_backend=settings.compile_backend)
        return TrainingOptions(compile=settings.compile, activation_checkpoint=settings.activation_checkpoint,
                               amp=settings.amp, compile_backend=settings.compile_backend)

    # -- the forecast --------------------------------------------------------------------------------
    def forecast_done(self, path, digest):
        """How many whole steps the forecast store at ``path`` already holds of this very forecast (from the same
        weights and initial time); a store of anything else is removed. The same on every rank."""
        done = 0
        if self.rank == 0 and os.path.exists(path):
            try:
                group = zarr.open_group(path, mode="r")
                same = (group.attrs.get("model_digest") == digest and
                        group.attrs.get("initial_time") == str(self.data[TIME].values[self.init_time]))
                if same:  # the steps a killed run committed: its time coordinate's (write_tile commits it last)
                    stored = zarr.open_array(os.path.join(path, TIME), mode="r")
                    times = xr.conventions.decode_cf_variable(
                        TIME, xr.Variable((TIME,), stored[...], dict(stored.attrs))).values
                    done = min(len(times), self.settings.rollout)
                    want = self.data[TIME].values[self.init_time + 1:self.init_time + 1 + done]
                    if not np.array_equal(times[:done], want):
                        done = 0
            except Exception:  # noqa: BLE001 - a store left in a state we cannot read: rebuilt
                done = 0
            if done == 0:
                shutil.rmtree(path, ignore_errors=True)
        return self.world.bcast(done, root=0)

    def forecast(self, model, path, done, digest, stop):
        """Roll the model out from the initial time on every domain group (the first writes each step after the
        first ``done`` by tile); a stop signal is settled after each lead. Return the per-channel RMSE of the
        forecast and of persistence at each lead (rows: leads)."""
        settings, manager = self.settings, self.manager
        mean, std = self.scale
        rmse, persistence = [], []
        writes = manager.dp_rank == 0
        store = CountingStore(LocalStore(path)) if writes else None
        truth0 = self.raw[self.init_time].unsqueeze(0)
        x = self.dataset[self.init_time].unsqueeze(0)
        model.eval()
        with torch.no_grad(), self.progress(settings.rollout, "forecast") as bar:
            for lead in range(1, settings.rollout + 1):
                x = model(x)
                physical = x.double() * std + mean
                truth = self.raw[self.init_time + lead].unsqueeze(0)
                rmse.append(latitude_weighted_rmse(physical, truth, self.latitude, manager))
                persistence.append(latitude_weighted_rmse(truth0, truth, self.latitude, manager))
                if writes and lead > done:
                    write_tile(self.tile_dataset(physical[0].to(self.dtype), self.init_time + lead, digest), store,
                               manager, append_dim=TIME)
                bar.update(1)
                if lead < settings.rollout and stop.requested():
                    raise _Stopped(f"stopped by {stop.received} during the forecast, after lead {lead}: {path} holds "
                                   f"{max(lead, done)} of {settings.rollout} steps; complete it with the same "
                                   "command and --resume auto")
        self.written = store.bytes_written if writes else 0
        return torch.stack(rmse), torch.stack(persistence)

    def tile_dataset(self, channels, index, digest):
        """This rank's tile of one forecast step as a Dataset of the source's variables (physical units)."""
        variables, at = {}, 0
        values = channels.numpy()
        for name, levels in self.layout:
            attrs = dict(self.data[name].attrs)
            if levels:
                variables[name] = ((TIME, LEVEL, LAT, LON), values[None, at:at + levels], attrs)
            else:
                variables[name] = ((TIME, LAT, LON), values[None, at], attrs)
            at += levels or 1
        coords = {TIME: self.data[TIME].values[index:index + 1], LAT: self.latitude, LON: self.longitude}
        if any(levels for _, levels in self.layout):
            coords[LEVEL] = self.data[LEVEL].values
        return xr.Dataset(variables, coords=coords,
                          attrs={"initial_time": str(self.data[TIME].values[self.init_time]), "model_digest": digest})


def _mib(n):
    return n / 2**20


def run_forecast(settings, out=print):
    """Run the whole job of :class:`ForecastSettings`; print progress and one summary line; return 0.

    Collective over ``MPI.COMM_WORLD``: call on every rank with the same settings. Everything that can be checked
    before work starts is checked first, alike on every rank (the settings, the packages, the output folders,
    the data's variables and grid against the model and layout, the checkpoint to resume): a mistake raises
    :class:`mpidomain.command.UsageError` on every rank. A stop signal (``settings.stop_signals``) reaching any
    rank ends the run at the next step boundary or forecast lead, with a checkpoint, returning 0.
    """
    required, optional = requirements(settings)
    missing = require("forecast", required, optional=optional)
    if settings.model == "crossformer":
        reason = credit_missing()
        agreed(world(), "forecast: --model crossformer", lambda: _refuse(
            f"--model crossformer needs CREDIT's CrossFormer, which does not import here: {reason}") if reason else None)
    job = _Job(settings, out, plain_progress=bool(missing))
    if missing:
        job.say("progress: tqdm is not installed, so progress comes as plain lines (pip install tqdm for a bar)")
    started = time.perf_counter()
    # Held for the whole run: MPI's own handler of SIGUSR1 is replaced once, and a signal anywhere is recorded.
    with StopSignals(job.world, settings.stop_signals) as stop:
        try:
            return _run(job, stop, started)
        except _Stopped as stopped:
            job.say(str(stopped))
            _summary(job, job.model, time.perf_counter() - started, "stopped")
            return 0
        finally:
            job.manager.close()


def _refuse(message):
    raise UsageError(message)


def _run(job, stop, started):
    settings, manager = job.settings, job.manager
    prepare_outputs(settings, job.folder, job.world, job.checkpoints)
    job.describe_data()
    job.model = name = job.model_name()
    model = job.build_model(name)
    resumed = job.resume_state(name)
    job.open_data()
    statistics = resumed["statistics"] if resumed else job.statistics()
    job.samples(statistics)
    if settings.estimate:
        return _estimate(job, name)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    first = job.restore(model, optimizer, resumed) if resumed else 1
    job.say(f"mpidomain forecast: {job.size} ranks = {manager.data_parallel_size} data-parallel group(s) x "
            f"D={settings.domain_text(job.size)} ({'tiles' if manager.tiled else 'latitude slabs'}); {name} model, "
            f"{settings.dtype}, {job.training_options().summary()}; {len(job.channels)} channels ({', '.join(job.channels)}) on {job.grid[0]} x "
            f"{job.grid[1]}; data {job.data_path}")
    checkpoint = job.train(model, optimizer, name, statistics, first, stop)
    job.say(f"checkpoint after step {len(job.losses)}: {checkpoint}")
    if settings.stop_after is None:
        # The forecast runs from the checkpoint on disk, as a later job would: a fresh model, its weights loaded.
        forecaster = job.build_model(name)
        state = agreed(job.world, "forecast: reading the checkpoint",
                       lambda: torch.load(checkpoint, map_location="cpu", weights_only=False))
        job.load_weights(forecaster, state, checkpoint)
        digest = _digest(forecaster.state_dict())
        forecaster = prepare_training(forecaster, job.training_options(forecast=True), manager=manager).model
        path = os.path.join(job.folder, "forecast.zarr")
        done = job.forecast_done(path, digest) if settings.resume else 0
        if not settings.resume and job.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        if 0 < done < settings.rollout:
            job.say(f"completing the forecast in {path}: {done} of {settings.rollout} steps are there")
        barrier(job.world, "forecast: preparing the forecast store")
        rmse = job.forecast(forecaster, path, done, digest, stop)
        barrier(job.world, "forecast: the forecast")
        if job.rank == 0:
            _report(job, rmse, path)
        if settings.plot:
            from .plot import draw

            agreed(job.world, "forecast: --plot", lambda: draw(settings.plot, job, path) if job.rank == 0 else None)
            job.say(f"picture: {settings.plot}")
    _summary(job, name, time.perf_counter() - started, "stopped" if settings.stop_after else "done")
    return 0


def _report(job, rmse, path):
    model, persistence = rmse
    out = job.print
    out(f"forecast of {job.settings.rollout} steps from {str(job.data[TIME].values[job.init_time])[:16]} written "
        f"by tile to {path}")
    out("latitude-weighted RMSE by lead (model / persistence):")
    leads = range(model.shape[0])
    out(f"  {'channel':<10} " + " ".join(f"{'lead ' + str(k + 1):>19}" for k in leads))
    for c, channel in enumerate(job.channels):
        cells = " ".join(f"{float(model[k, c]):>9.4g} / {float(persistence[k, c]):<7.4g}" for k in leads)
        out(f"  {channel:<10} {cells}")


def _summary(job, name, seconds, outcome):
    peak = job.world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=mpi().MAX)
    read = job.world.allreduce(job.store.bytes_read if job.store is not None else 0, op=mpi().MAX)
    written = job.world.allreduce(job.written, op=mpi().MAX)
    if job.rank == 0:
        finite = [loss for loss in job.losses if math.isfinite(loss)]
        losses = f"loss {finite[0]:.6g} -> {finite[-1]:.6g} after {len(job.losses)} steps" if finite else "no step trained"
        skipped = f" ({len(job.skipped)} skipped: not finite)" if job.skipped else ""
        per_step = f"{float(np.median(job.step_seconds)):.3f} s/step; " if job.step_seconds else ""
        job.print(f"forecast {outcome}: {name} {job.settings.dtype} ({job.training_options().summary()}), D={job.settings.domain_text(job.size)} x "
                  f"{job.manager.data_parallel_size} group(s); {losses}{skipped}; {per_step}peak {_mib(peak):.0f} "
                  f"MiB/rank; read {_mib(read):.2f} MiB/rank, wrote {_mib(written):.2f} MiB/rank; {seconds:.1f} s")


def _estimate(job, name):
    """Print what one training step's forward saves for backward on the largest rank, predicted before any
    activation exists (:func:`mpidomain.nn.estimate_memory`), for this layout and for one process."""
    settings = job.settings
    per_group = settings.batch // job.manager.data_parallel_size
    shape = (per_group, len(job.channels), *job.grid)
    estimate = estimate_memory(job.single_model(name), shape, job.manager, custom_converters=custom_converters)
    job.say(f"estimate for {name} {settings.dtype}, batch {per_group} per domain group: {estimate}")
    job.say(f"training steps save {estimate.bytes_per_rank / 2**20:.1f} MiB per rank, the "
            f"{settings.train_rollout}-step fine-tuning "
            f"{settings.train_rollout * estimate.bytes_per_rank / 2**20:.1f} MiB (each step of a rollout "
            "saves as much again)")
    return 0

"""The whole job, from disk to disk: :func:`run_forecast`.

Every rank reads only its tile of the store, trains the domain-parallel model on its
group's samples, rolls forecasts out on its tile and writes its tile of the forecast;
no rank ever holds the whole field (but for the picture, which draws one field).

Long runs survive their end: numbered checkpoints (every ``checkpoint_every``
steps, the newest ``keep`` kept, each written whole or not at all), a clean stop
at the next step boundary on the scheduler's signal, ``resume="auto"`` from the
newest complete checkpoint, and a forecast store that holds only whole steps
after a kill and is completed by the resumed run.
"""

import hashlib
import math
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
import xarray as xr
import zarr
from zarr.storage import LocalStore

from .._agreement import agree
from .._mpi import mpi
from .._waits import wait_all
from ..checkpoints import CheckpointFolder, restore_rng_states, rng_states
from ..command import UsageError, agreed, decided, require, world
from ..data import CountingStore, TileDataset, select_tile, write_tile
from ..manager import initialize_domain_parallel, library_comm
from ..models import UNet, convert_model, credit_crossformer, credit_missing, custom_converters
from ..nn import LatitudeWeightedMSE, allreduce_gradients, estimate_memory, latitude_weighted_rmse
from ..preemption import StopSignals
from ..reduce import allreduce
from .settings import requirements
from .synthetic import write_synthetic_store

__all__ = ["run_forecast", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "mpidomain-forecast-2"
_READABLE_FORMATS = ("mpidomain-forecast-1", CHECKPOINT_FORMAT)
LAT, LON, TIME, LEVEL = "latitude", "longitude", "time", "level"
_GRID_DIMS = ({TIME, LAT, LON}, {TIME, LEVEL, LAT, LON})  # the dims of a variable the job can model


def _settings_differ(descriptions):
    fields = [k for k in descriptions[0] if any(d[k] != descriptions[0][k] for d in descriptions)]
    listing = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {d[k]}" for r, d in enumerate(descriptions)) for k in fields)
    return UsageError(f"the forecast's settings must be the same on every rank, but they differ in {listing}; "
                      "call run_forecast with the same settings on every rank")


def _refuse(message):
    raise UsageError(message)


def _barrier(comm, call):
    wait_all([comm.Ibarrier()], comm=comm, call=call)


def _probe_writable(folder):
    """Raise OSError unless a file can be created in ``folder``; local."""
    probe = os.path.join(folder, f".mpidomain-write-test-{os.getpid()}")
    with open(probe, "wb") as file:
        file.write(b"ok")
    os.remove(probe)


def _digest(state_dict):
    """A digest of a model's weights: the same on every rank holding the same weights."""
    hashed = hashlib.blake2b(digest_size=12)
    for name, tensor in state_dict.items():
        hashed.update(name.encode())
        hashed.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return hashed.hexdigest()


class _Job:
    """One run's state: the manager, the data, the model, what was measured."""

    def __init__(self, settings, out):
        self.settings, self.print = settings, out
        comm = world()
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        problems = settings.problems(self.size)
        agree(comm, "forecast: the settings", {k: repr(v) for k, v in vars(settings).items()},
              error=UsageError("; ".join(problems)) if problems else None, mismatch=_settings_differ)
        shape = settings.domain_shape(self.size)
        tiles = len(shape) == 2
        self.manager = initialize_domain_parallel(self.size, shape if tiles else shape[0], (-2, -1) if tiles else -2)
        self.world = library_comm(self.manager, "world")
        # The ranks of a node share its cores: torch's threads per rank, so that no core is oversubscribed.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.manager.local_size))
        self.dtype = torch.float64 if settings.dtype == "float64" else torch.float32
        self.losses, self.step_seconds, self.skipped = [], [], []
        self.written = 0
        self.plain_progress = False

    def say(self, line):
        """Print ``line`` once (world rank 0)."""
        if self.rank == 0:
            self.print(line)

    # -- the outputs, checked before any work -------------------------------------------------------------
    def prepare_outputs(self):
        """Make ``--out`` (or a temporary folder) and check it and ``--plot``'s folder writable, on every rank."""
        settings = self.settings
        if settings.out is None:
            self.folder = self.world.bcast(tempfile.mkdtemp(prefix="mpidomain-forecast-") if self.rank == 0 else None)
        else:
            self.folder = os.path.abspath(settings.out)

        def not_a_file():
            if os.path.exists(self.folder) and not os.path.isdir(self.folder):
                raise UsageError(f"--out {settings.out}: a file, not a folder; give a folder for the checkpoints "
                                 "and the forecast (it is made if it does not exist)")
        agreed(self.world, "forecast: --out", not_a_file)

        def make():
            try:
                os.makedirs(self.folder, exist_ok=True)
                _probe_writable(self.folder)
            except OSError as error:
                raise UsageError(f"--out {settings.out}: cannot write there ({type(error).__name__}: "
                                 f"{error.strerror or error}); choose a folder this job can write") from None
        decided(self.world, "forecast: making --out", make)

        def visible():
            if not os.path.isdir(self.folder):
                raise UsageError(f"--out {self.folder}: made by rank 0 but not seen by this rank; give a folder on "
                                 "a file system every rank shares")
        agreed(self.world, "forecast: --out on every rank", visible)
        if settings.plot:
            plot = os.path.abspath(settings.plot)
            parent = os.path.dirname(plot)

            def plot_folder():
                if os.path.isdir(plot):
                    raise UsageError(f"--plot {settings.plot}: a folder; give the PNG file to draw, e.g. "
                                     f"{os.path.join(settings.plot, 'forecast.png')}")
                if not os.path.isdir(parent):
                    raise UsageError(f"--plot {settings.plot}: the folder {parent} does not exist; make it first or "
                                     "draw elsewhere")
            agreed(self.world, "forecast: --plot", plot_folder)

            def writable():
                try:
                    _probe_writable(parent)
                except OSError as error:
                    raise UsageError(f"--plot {settings.plot}: cannot write to {parent} ({type(error).__name__}: "
                                     f"{error.strerror or error}); draw elsewhere") from None
            decided(self.world, "forecast: --plot writable", writable)
        self.checkpoints = CheckpointFolder(self.folder, "checkpoint", keep=settings.keep, latest="checkpoint.pt")

    # -- the data ------------------------------------------------------------------------------------
    def open_data(self):
        settings = self.settings
        path = settings.data
        if path is None:
            path = os.path.join(self.folder, "era5-synthetic.zarr")
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            _barrier(self.world, "the synthetic store")
            write_synthetic_store(path, self.manager, settings.grid, settings.times, settings.seed)
        self.data_path = path

        def open_store():
            if not os.path.isdir(path):
                raise UsageError(f"--data {path}: no such Zarr store (a folder); give an existing store, or leave "
                                 "--data out for a synthetic one")
            store = CountingStore(LocalStore(path, read_only=True))
            try:
                return store, xr.open_zarr(store, consolidated=False, chunks=None)
            except Exception as error:  # noqa: BLE001 - whatever zarr or xarray make of a folder that is no store
                raise UsageError(f"--data {path}: not a Zarr store xarray can open ({type(error).__name__}: "
                                 f"{str(error).splitlines()[0] if str(error) else ''})") from None

        self.store, self.data = agreed(self.world, "forecast: opening --data", open_store)
        self.variables = agreed(self.world, "forecast: --variables", self._variables)
        times = self.data.sizes[TIME]
        need = settings.rollout + settings.train_rollout + 2
        if times < need:
            raise UsageError(f"--data {path}: {times} time steps, but training on {settings.train_rollout}-step "
                             f"rollouts and a {settings.rollout}-step forecast need at least {need}; use a longer "
                             "store or smaller --rollout / --train-rollout")
        self.init_time = times - settings.rollout - 1  # the forecast starts here; training uses the times before
        raw = TileDataset(self.data, self.variables, manager=self.manager, dtype=torch.float64)
        self.channels = raw.channels
        tile = select_tile(self.data[self.variables[:1]], self.manager)  # lazy: its coordinates alone are read
        self.latitude, self.longitude = tile[LAT].values, tile[LON].values
        self.raw = raw

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

    def layout(self):
        """The channels' variables in TileDataset's order: (name, levels or None), upper-air first, then surface."""
        upper = [(v, self.data.sizes[LEVEL]) for v in self.variables if LEVEL in self.data[v].dims]
        return upper + [(v, None) for v in self.variables if LEVEL not in self.data[v].dims]

    def statistics(self):
        """Per-variable mean and standard deviation over the training times' finite values (by tile, summed over
        the group): a NaN in the data is found by the step that draws it, not spread into every sample."""
        tile = select_tile(self.data[self.variables], self.manager)
        sums = []
        for name, levels in self.layout():
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
        for name, levels in self.layout():
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
        for name, levels in self.layout():
            for i, statistic in enumerate((mean, std)):
                per_channel[i] += list(np.broadcast_to(statistic[name], (levels or 1,)))
        self.scale = tuple(torch.tensor(values, dtype=torch.float64)[:, None, None] for values in per_channel)

    # -- the model -----------------------------------------------------------------------------------
    def model_name(self):
        if self.settings.model != "auto":
            return self.settings.model
        reasons = self.world.allgather(credit_missing())
        return "cnn" if any(reasons) else "crossformer"

    def single_model(self, name):
        """The model on one process's terms, seeded (the same weights on every rank and at every layout)."""
        torch.manual_seed(self.settings.seed)
        height, width = self.data.sizes[LAT], self.data.sizes[LON]
        if name == "crossformer":
            upper = [v for v in self.variables if LEVEL in self.data[v].dims]
            levels = self.data.sizes[LEVEL] if upper else 0
            # Windows that keep the groups of rows and columns small (16: four stride-2 stages, windows <= 1 at the
            # last two), so that the default grid splits into 4 slabs or 2 x 2 tiles.
            model = agreed(self.world, "forecast: --model crossformer", lambda: credit_crossformer(
                len(upper), levels, len(self.variables) - len(upper), height, width, local_window_size=1,
                global_window_size=(2, 2, 1, 1)))
        else:
            model = UNet(len(self.channels), width=16)
        return model.to(self.dtype)

    def build_model(self, name):
        """The model, seeded, converted to domain-parallel."""
        model = self.single_model(name)
        return agreed(self.world, f"forecast: converting the {name} model", lambda: convert_model(model, self.manager))

    # -- checkpoints ---------------------------------------------------------------------------------
    def _check_format(self, state, path):
        """Raise UsageError unless ``state`` is a checkpoint of this command that fits this run."""
        if not isinstance(state, dict) or state.get("format") not in _READABLE_FORMATS:
            raise UsageError(f"--resume {path}: not a checkpoint of python -m mpidomain forecast; give one a forecast "
                             "run saved, or --resume auto")

    def _check_fits(self, state, path, name):
        grid = (self.data.sizes[LAT], self.data.sizes[LON])
        for what, theirs, ours in (("channels", tuple(state["channels"]), tuple(self.channels)),
                                   ("grid", tuple(state["grid"]), grid),
                                   ("--dtype", state["dtype"], self.settings.dtype),
                                   ("--model", state["model_name"], name)):
            if theirs != ours:
                raise UsageError(f"--resume {path}: the checkpoint's {what} is {theirs}, this run's is {ours}; "
                                 "resume with the settings that saved it")
        if state["step"] > self.settings.steps:
            raise UsageError(f"--resume {path}: the checkpoint is after step {state['step']}, past --steps "
                             f"{self.settings.steps}; raise --steps to train on, or resume an earlier checkpoint")

    def resume_state(self, name):
        """The state to resume from (``--resume PATH`` or ``auto``), checked on every rank; None to start fresh."""
        settings = self.settings
        if not settings.resume:
            return None
        if settings.resume == "auto":
            def loads(state):
                self._check_format(state, "auto")
            path, state, skipped = self.checkpoints.newest(self.world, check=loads)
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
            if not os.path.isfile(path):
                raise UsageError(f"--resume {path}: no such file; give a checkpoint a forecast run saved, or "
                                 "--resume auto")
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
            except Exception as error:  # noqa: BLE001 - a corrupt, empty or foreign file
                text = str(error).splitlines()[0][:160] if str(error) else ""
                raise UsageError(f"--resume {path}: not a readable checkpoint ({type(error).__name__}: {text}); "
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
                                 f"{'; '.join(p for p in parts if p) or str(error).splitlines()[0]}; resume with "
                                 "the --model, --variables and data that saved it") from None
        agreed(self.world, "forecast: loading the checkpoint's weights", load)

    def save(self, model, optimizer, step, name, statistics):
        """Save the checkpoint after ``step`` (numbered, the newest ``keep`` kept; ``checkpoint.pt`` the newest)."""
        state = {"format": CHECKPOINT_FORMAT, "step": step, "model_name": name, "channels": self.channels,
                 "grid": (self.data.sizes[LAT], self.data.sizes[LON]), "dtype": self.settings.dtype,
                 "statistics": statistics, "losses": list(self.losses), "model": model.state_dict(),
                 "optimizer": optimizer.state_dict(), "rng": rng_states(),
                 "settings": {k: getattr(self.settings, k) for k in ("steps", "train_rollout", "batch", "lr", "seed")}}
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
        return f"step {step}: {found[0]}"

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

    def train_step(self, model, optimizer, loss_function, step):
        """One optimizer step; return its loss (the mean over the data-parallel groups), or None if skipped."""
        rollout = self.rollout_of(step)
        starts = self.starts(step, rollout)
        inputs = [self.dataset[t] for t in starts]
        targets = [[self.dataset[t + k] for t in starts] for k in range(1, rollout + 1)]
        problem = self._sample_problem(inputs + [y for ys in targets for y in ys],
                                       starts + [t + k for k in range(1, rollout + 1) for t in starts])
        message = self._not_finite(step, "samples", problem)
        if message is None:
            optimizer.zero_grad(set_to_none=True)
            x, total = torch.stack(inputs), 0
            for k in range(1, rollout + 1):
                x = model(x)
                total = total + loss_function(x, torch.stack(targets[k - 1]))
            loss = total / rollout
            value = float(loss.detach())
            message = self._not_finite(step, "loss", None if math.isfinite(value) else
                                       f"the loss is not finite ({value}) on data-parallel group {self.manager.dp_rank}")
        if message is not None:
            if not self.settings.skip_nan:
                raise UsageError(f"{message}; clean the data or lower --lr, or pass --skip-nan to skip such steps")
            self.say(f"skipped {message}")
            self.skipped.append(step)
            return None
        loss.backward()
        allreduce_gradients(model, group="domain", op="sum", manager=self.manager)
        allreduce_gradients(model, group="data_parallel", op="mean", manager=self.manager)
        optimizer.step()
        return float(allreduce(loss.detach(), "mean", "data_parallel", self.manager))

    def train(self, model, optimizer, name, statistics, first):
        """Train from step ``first``; checkpoint periodically; stop cleanly on a signal. Return the last step, and
        the stop line (None unless a signal stopped the run)."""
        settings = self.settings
        loss_function = LatitudeWeightedMSE(self.latitude, self.manager)
        last = settings.stop_after or settings.steps
        model.train()
        with StopSignals(self.world, settings.stop_signals) as stop, \
                _progress(self, last, "train", initial=first - 1) as bar:
            for step in range(first, last + 1):
                began = time.perf_counter()
                loss = self.train_step(model, optimizer, loss_function, step)
                self.losses.append(math.nan if loss is None else loss)
                self.step_seconds.append(self.world.allreduce(time.perf_counter() - began, op=mpi().MAX))
                bar.set_postfix_str(f"loss {self.losses[-1]:.4g}, rollout {self.rollout_of(step)}")
                bar.update(1)
                stopping = stop.requested()
                if stopping or step == last or (settings.checkpoint_every and step % settings.checkpoint_every == 0):
                    path = self.save(model, optimizer, step, name, statistics)
                    if stopping:
                        return step, (f"stopped by {stop.received} after step {step}: checkpoint {path}; continue with "
                                      f"the same command and --resume auto (--out {self.folder})")
        if first > last:
            self.say(f"nothing to train: the checkpoint is after step {first - 1} of {last}")
        return last, None

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

    def forecast(self, model, path, done, digest):
        """Roll the model out from the initial time on the first domain group; write each step after the first
        ``done`` by tile. Return the per-channel RMSE of the forecast and of persistence at each lead (rows: leads)."""
        settings, manager = self.settings, self.manager
        mean, std = self.scale
        rmse, persistence = [], []
        store = CountingStore(LocalStore(path))
        truth0 = self.raw[self.init_time].unsqueeze(0)
        x = self.dataset[self.init_time].unsqueeze(0)
        problem = self._sample_problem([x[0]], [self.init_time])
        if agree(library_comm(manager, "domain"), "forecast: a finite initial state", None, flag=problem is not None):
            found = [p for p in library_comm(manager, "domain").allgather(problem) if p]
            raise UsageError(f"the forecast's initial state: {found[0]}; clean the data")
        model.eval()
        with torch.no_grad(), _progress(self, settings.rollout, "forecast") as bar:
            for lead in range(1, settings.rollout + 1):
                x = model(x)
                physical = x.double() * std + mean
                truth = self.raw[self.init_time + lead].unsqueeze(0)
                rmse.append(latitude_weighted_rmse(physical, truth, self.latitude, manager))
                persistence.append(latitude_weighted_rmse(truth0, truth, self.latitude, manager))
                if lead > done:
                    write_tile(self.tile_dataset(physical[0].to(self.dtype), self.init_time + lead, digest), store,
                               manager, append_dim=TIME)
                bar.update(1)
        self.written = store.bytes_written
        return torch.stack(rmse), torch.stack(persistence)

    def tile_dataset(self, channels, index, digest):
        """This rank's tile of one forecast step as a Dataset of the source's variables (physical units)."""
        variables, at = {}, 0
        values = channels.numpy()
        for name, levels in self.layout():
            attrs = dict(self.data[name].attrs)
            if levels:
                variables[name] = ((TIME, LEVEL, LAT, LON), values[None, at:at + levels], attrs)
            else:
                variables[name] = ((TIME, LAT, LON), values[None, at], attrs)
            at += levels or 1
        coords = {TIME: self.data[TIME].values[index:index + 1], LAT: self.latitude, LON: self.longitude}
        if any(levels for _, levels in self.layout()):
            coords[LEVEL] = self.data[LEVEL].values
        return xr.Dataset(variables, coords=coords,
                          attrs={"initial_time": str(self.data[TIME].values[self.init_time]), "model_digest": digest})


class _Quiet:
    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Lines(_Quiet):
    """Progress as plain lines on stderr (about ten per phase), where tqdm is not installed."""

    def __init__(self, total, what, initial):
        self.total, self.what, self.done, self.postfix = total, what, initial, ""
        self.every = max(1, (total - initial) // 10)

    def set_postfix_str(self, text):
        self.postfix = text

    def update(self, n=1):
        self.done += n
        if self.done == self.total or self.done % self.every == 0:
            print(f"{self.what}: {self.done}/{self.total} steps{', ' + self.postfix if self.postfix else ''}",
                  file=sys.stderr, flush=True)


def _progress(job, total, what, initial=0):
    """A tqdm bar on world rank 0 (stderr), plain lines where tqdm is missing, a silent one elsewhere."""
    if job.rank != 0:
        return _Quiet()
    if job.plain_progress:
        return _Lines(total, what, initial)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=what, unit="step", dynamic_ncols=True, leave=True)


def _mib(n):
    return n / 2**20


def run_forecast(settings, out=print):
    """Run the whole job of :class:`ForecastSettings`; print progress and one summary line; return 0.

    Collective over ``MPI.COMM_WORLD``: call on every rank with the same settings. Everything that can be checked
    before work starts is checked first, alike on every rank (the settings, the packages, the output folders,
    the data, the checkpoint to resume): a mistake raises :class:`mpidomain.command.UsageError` on every rank.
    """
    required, optional = requirements(settings)
    missing = require("forecast", required, optional=optional)
    if settings.model == "crossformer":
        reason = credit_missing()
        agreed(world(), "forecast: --model crossformer",
               lambda: _refuse(f"--model crossformer needs CREDIT's CrossFormer, which does not import here: {reason}")
               if reason else None)
    job = _Job(settings, out)
    job.plain_progress = bool(missing)
    if missing:
        job.say("progress: tqdm is not installed, so progress comes as plain lines (pip install tqdm for a bar)")
    manager = job.manager
    try:
        started = time.perf_counter()
        job.prepare_outputs()
        job.open_data()
        name = job.model_name()
        resumed = job.resume_state(name)
        statistics = resumed["statistics"] if resumed else job.statistics()
        job.samples(statistics)
        if settings.estimate:
            return _estimate(job, name)
        model = job.build_model(name)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        first = 1
        if resumed:
            job.load_weights(model, resumed, job.resumed_from)
            optimizer.load_state_dict(resumed["optimizer"])
            if "rng" in resumed:
                restore_rng_states(resumed["rng"])
            job.losses, first = list(resumed["losses"]), resumed["step"] + 1
        groups = manager.data_parallel_size
        layout = "x".join(map(str, settings.domain_shape(job.size)))
        job.say(f"mpidomain forecast: {job.size} ranks = {groups} data-parallel group(s) x D={layout} "
                f"({'tiles' if manager.tiled else 'latitude slabs'}); {name} model, {settings.dtype}; "
                f"{len(job.channels)} channels ({', '.join(job.channels)}) on {job.data.sizes[LAT]} x "
                f"{job.data.sizes[LON]}; data {job.data_path}")
        last, stopped = job.train(model, optimizer, name, statistics, first)
        checkpoint = job.checkpoints.latest
        if stopped:
            job.say(stopped)
            _summary(job, name, layout, time.perf_counter() - started, "stopped")
            return 0
        job.say(f"checkpoint after step {last}: {checkpoint}")
        rmse = None
        if settings.stop_after is None:
            # The forecast runs from the checkpoint on disk, as a later job would: a fresh model, its weights loaded.
            forecaster = job.build_model(name)
            job.load_weights(forecaster, agreed(job.world, "forecast: reading the checkpoint",
                                                lambda: torch.load(checkpoint, map_location="cpu", weights_only=False)),
                             checkpoint)
            digest = _digest(forecaster.state_dict())
            path = os.path.join(job.folder, "forecast.zarr")
            done = job.forecast_done(path, digest) if settings.resume else 0
            if not settings.resume and job.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if 0 < done < settings.rollout:
                job.say(f"completing the forecast in {path}: {done} of {settings.rollout} steps are there")
            _barrier(job.world, "forecast: preparing the forecast store")
            if manager.dp_rank == 0:
                rmse = job.forecast(forecaster, path, done, digest)
            _barrier(job.world, "forecast: the forecast")
            if job.rank == 0:
                _report(job, rmse, path)
            if settings.plot:
                from .plot import draw

                agreed(job.world, "forecast: --plot", lambda: draw(settings.plot, job, path) if job.rank == 0 else None)
                job.say(f"picture: {settings.plot}")
        _summary(job, name, layout, time.perf_counter() - started,
                 "stopped" if settings.stop_after else "done")
        return 0
    finally:
        manager.close()


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


def _summary(job, name, layout, seconds, outcome):
    peak = job.world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=mpi().MAX)
    read = job.world.allreduce(job.store.bytes_read, op=mpi().MAX)
    written = job.world.allreduce(job.written, op=mpi().MAX)
    if job.rank == 0:
        steps = job.step_seconds
        per_step = float(np.median(steps)) if steps else math.nan
        finite = [loss for loss in job.losses if math.isfinite(loss)] or [math.nan]
        skipped = f" ({len(job.skipped)} skipped: not finite)" if job.skipped else ""
        job.print(f"forecast {outcome}: {name} {job.settings.dtype}, D={layout} x "
                  f"{job.manager.data_parallel_size} group(s); loss {finite[0]:.6g} -> {finite[-1]:.6g} after "
                  f"{len(job.losses)} steps{skipped}; {per_step:.3f} s/step; peak {_mib(peak):.0f} MiB/rank; "
                  f"read {_mib(read):.2f} MiB/rank, wrote {_mib(written):.2f} MiB/rank; {seconds:.1f} s")


def _estimate(job, name):
    """Print what one training step's forward saves for backward on the largest rank, predicted before any
    activation exists (:func:`mpidomain.nn.estimate_memory`), for this layout and for one process."""
    settings = job.settings
    per_group = settings.batch // job.manager.data_parallel_size
    shape = (per_group, len(job.channels), job.data.sizes[LAT], job.data.sizes[LON])
    estimate = estimate_memory(job.single_model(name), shape, job.manager, custom_converters=custom_converters)
    job.say(f"estimate for {name} {settings.dtype}, batch {per_group} per domain group: {estimate}")
    job.say(f"training steps save {estimate.bytes_per_rank / 2**20:.1f} MiB per rank, the "
            f"{settings.train_rollout}-step fine-tuning "
            f"{settings.train_rollout * estimate.bytes_per_rank / 2**20:.1f} MiB (each step of a rollout "
            "saves as much again)")
    return 0

"""The whole job, from disk to disk: :func:`run_forecast`.

Every rank reads only its tile of the store, trains the domain-parallel model on its
group's samples, rolls forecasts out on its tile and writes its tile of the forecast;
no rank ever holds the whole field (but for the picture, which draws one field).
"""

import math
import os
import resource
import shutil
import tempfile
import time

import numpy as np
import torch
import xarray as xr
from zarr.storage import LocalStore

from .._agreement import agree
from .._mpi import mpi
from .._waits import wait_all
from ..data import CountingStore, TileDataset, select_tile, write_tile
from ..manager import initialize_domain_parallel, library_comm
from ..models import UNet, convert_model, credit_crossformer, credit_missing, custom_converters
from ..nn import LatitudeWeightedMSE, allreduce_gradients, estimate_memory, latitude_weighted_rmse
from ..reduce import allreduce
from .synthetic import write_synthetic_store

__all__ = ["run_forecast", "CHECKPOINT_FORMAT"]

CHECKPOINT_FORMAT = "mpidomain-forecast-1"
LAT, LON, TIME, LEVEL = "latitude", "longitude", "time", "level"


def _agreed(comm, call, work):
    """Run ``work()`` on every rank; if it raises ValueError/TypeError/OSError on any, raise on all; return its result."""
    result = error = None
    try:
        result = work()
    except (ValueError, TypeError, OSError, KeyError) as exc:
        error = exc if isinstance(exc, (ValueError, TypeError)) else ValueError(f"{type(exc).__name__}: {exc}")
    agree(comm, call, None, error=error)
    return result


def _barrier(comm, call):
    wait_all([comm.Ibarrier()], comm=comm, call=call)


class _Job:
    """One run's state: the manager, the data, the model, what was measured."""

    def __init__(self, settings, out):
        self.settings, self.print = settings, out
        world = mpi().COMM_WORLD
        self.size, self.rank = world.Get_size(), world.Get_rank()
        problems = settings.problems(self.size)
        if problems:  # the same on every rank: every rank parsed the same command line
            raise ValueError("; ".join(problems))
        shape = settings.domain_shape(self.size)
        tiles = len(shape) == 2
        self.manager = initialize_domain_parallel(self.size, shape if tiles else shape[0], (-2, -1) if tiles else -2)
        self.world = library_comm(self.manager, "world")
        # The ranks of a node share its cores: torch's threads per rank, so that no core is oversubscribed.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.manager.local_size))
        self.dtype = torch.float64 if settings.dtype == "float64" else torch.float32
        self.losses, self.step_seconds = [], []
        self.written = 0

    # -- the data ------------------------------------------------------------------------------------
    def open_data(self):
        settings = self.settings
        folder = settings.out
        if folder is None:
            folder = self.world.bcast(tempfile.mkdtemp(prefix="mpidomain-forecast-") if self.rank == 0 else None)
        self.folder = folder
        path = settings.data
        if path is None:
            path = os.path.join(folder, "era5-synthetic.zarr")
            if self.rank == 0:
                os.makedirs(folder, exist_ok=True)
                shutil.rmtree(path, ignore_errors=True)
            _barrier(self.world, "the synthetic store")
            write_synthetic_store(path, self.manager, settings.grid, settings.times, settings.seed)
        self.data_path = path

        def open_store():
            if not os.path.isdir(path):
                raise ValueError(f"--data {path}: no such Zarr store (a folder); give an existing store, or leave "
                                 "--data out for a synthetic one")
            store = CountingStore(LocalStore(path, read_only=True))
            return store, xr.open_zarr(store, consolidated=False, chunks=None)

        self.store, self.data = _agreed(self.world, "forecast: opening --data", open_store)
        self.variables = _agreed(self.world, "forecast: --variables", self._variables)
        times = self.data.sizes[TIME]
        need = settings.rollout + settings.train_rollout + 2
        if times < need:
            raise ValueError(f"--data {path}: {times} time steps, but training on {settings.train_rollout}-step "
                             f"rollouts and a {settings.rollout}-step forecast need at least {need}; use a longer "
                             "store or smaller --rollout / --train-rollout")
        self.init_time = times - settings.rollout - 1  # the forecast starts here; training uses the times before
        raw = TileDataset(self.data, self.variables, manager=self.manager, dtype=torch.float64)
        self.channels = raw.channels
        tile = select_tile(self.data[self.variables[:1]], self.manager)  # lazy: its coordinates alone are read
        self.latitude, self.longitude = tile[LAT].values, tile[LON].values
        self.raw = raw

    def _variables(self):
        data = self.data
        names = list(self.settings.variables) if self.settings.variables else sorted(  # the store lists in any order
            v for v in data.data_vars if {TIME, LAT, LON} <= set(data[v].dims))
        missing = [v for v in names if v not in data.data_vars]
        if missing:
            raise ValueError(f"--variables {','.join(names)}: {missing} not in the store, whose variables are "
                             f"{list(data.data_vars)}")
        wrong = [v for v in names if not {TIME, LAT, LON} <= set(data[v].dims)]
        if wrong:
            raise ValueError(f"--variables: {wrong} lack one of the dims ({TIME}, {LAT}, {LON}); choose variables "
                             "on the time x latitude x longitude grid")
        if not names:
            raise ValueError(f"--data {self.data_path}: no variable has the dims ({TIME}, {LAT}, {LON})")
        return names

    def layout(self):
        """The channels' variables in TileDataset's order: (name, levels or None), upper-air first, then surface."""
        upper = [(v, self.data.sizes[LEVEL]) for v in self.variables if LEVEL in self.data[v].dims]
        return upper + [(v, None) for v in self.variables if LEVEL not in self.data[v].dims]

    def statistics(self):
        """Per-variable mean and standard deviation over the training times (by tile, summed over the group)."""
        tile = select_tile(self.data[self.variables], self.manager)
        sums = []
        for name, levels in self.layout():
            values = tile[name].isel({TIME: slice(0, self.init_time)}).values.astype(np.float64)
            axes = tuple(i for i, d in enumerate(tile[name].dims) if d != LEVEL)
            sums += [values.sum(axis=axes).ravel(), np.square(values).sum(axis=axes).ravel(),
                     np.full(levels or 1, values.size / (levels or 1))]
        flat = np.concatenate(sums)
        total = np.empty_like(flat)
        library_comm(self.manager, "domain").Allreduce(flat, total)
        mean, std, at = {}, {}, 0
        for name, levels in self.layout():
            s, q, count = (total[at + i * (levels or 1):at + (i + 1) * (levels or 1)] for i in range(3))
            at += 3 * (levels or 1)
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
            model = _agreed(self.world, "forecast: --model crossformer", lambda: credit_crossformer(
                len(upper), levels, len(self.variables) - len(upper), height, width, local_window_size=1,
                global_window_size=(2, 2, 1, 1)))
        else:
            model = UNet(len(self.channels), width=16)
        return model.to(self.dtype)

    def build_model(self, name):
        """The model, seeded, converted to domain-parallel."""
        model = self.single_model(name)
        return _agreed(self.world, f"forecast: converting the {name} model",
                       lambda: convert_model(model, self.manager))

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

    def train_step(self, model, optimizer, loss_function, step):
        rollout = self.rollout_of(step)
        starts = self.starts(step, rollout)
        x = torch.stack([self.dataset[t] for t in starts])
        optimizer.zero_grad(set_to_none=True)
        total = 0
        for k in range(1, rollout + 1):
            x = model(x)
            total = total + loss_function(x, torch.stack([self.dataset[t + k] for t in starts]))
        loss = total / rollout
        loss.backward()
        allreduce_gradients(model, group="domain", op="sum", manager=self.manager)
        allreduce_gradients(model, group="data_parallel", op="mean", manager=self.manager)
        optimizer.step()
        return float(allreduce(loss.detach(), "mean", "data_parallel", self.manager))

    def save(self, path, model, optimizer, step, name, statistics):
        if self.rank == 0:
            state = {"format": CHECKPOINT_FORMAT, "step": step, "model_name": name, "channels": self.channels,
                     "grid": (self.data.sizes[LAT], self.data.sizes[LON]), "dtype": self.settings.dtype,
                     "statistics": statistics, "losses": list(self.losses), "model": model.state_dict(),
                     "optimizer": optimizer.state_dict()}
            torch.save(state, path + ".partial")
            os.replace(path + ".partial", path)
        _barrier(self.world, "forecast: saving the checkpoint")

    def load(self, path, name=None):
        def read():
            if not os.path.isfile(path):
                raise ValueError(f"--resume {path}: no such file; give a checkpoint a forecast run saved")
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
                raise ValueError(f"--resume {path}: not a checkpoint of python -m mpidomain forecast")
            grid = (self.data.sizes[LAT], self.data.sizes[LON])
            for what, theirs, ours in (("channels", tuple(state["channels"]), tuple(self.channels)),
                                       ("grid", tuple(state["grid"]), grid),
                                       ("--dtype", state["dtype"], self.settings.dtype),
                                       ("--model", state["model_name"], name or state["model_name"])):
                if theirs != ours:
                    raise ValueError(f"--resume {path}: the checkpoint's {what} is {theirs}, this run's is {ours}; "
                                     "resume with the settings that saved it")
            return state
        return _agreed(self.world, "forecast: --resume", read)

    # -- the forecast --------------------------------------------------------------------------------
    def forecast(self, model, path):
        """Roll the model out from the initial time on the first domain group; write each step by tile.

        Return the per-channel RMSE of the forecast and of persistence at each lead (rows: leads), on that group.
        """
        settings, manager = self.settings, self.manager
        mean, std = self.scale
        rmse, persistence = [], []
        store = CountingStore(LocalStore(path))
        truth0 = self.raw[self.init_time].unsqueeze(0)
        x = self.dataset[self.init_time].unsqueeze(0)
        model.eval()
        with torch.no_grad(), _progress(self, settings.rollout, "forecast") as bar:
            for lead in range(1, settings.rollout + 1):
                x = model(x)
                physical = x.double() * std + mean
                truth = self.raw[self.init_time + lead].unsqueeze(0)
                rmse.append(latitude_weighted_rmse(physical, truth, self.latitude, manager))
                persistence.append(latitude_weighted_rmse(truth0, truth, self.latitude, manager))
                write_tile(self.tile_dataset(physical[0].to(self.dtype), self.init_time + lead), store, manager,
                           append_dim=TIME)
                bar.update(1)
        self.written = store.bytes_written
        return torch.stack(rmse), torch.stack(persistence)

    def tile_dataset(self, channels, index):
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
                          attrs={"initial_time": str(self.data[TIME].values[self.init_time])})


class _Quiet:
    def update(self, n=1):
        pass

    def set_postfix_str(self, text):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress(job, total, what, initial=0):
    """A tqdm bar on world rank 0 (stderr), a silent one elsewhere."""
    if job.rank != 0:
        return _Quiet()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=what, unit="step", dynamic_ncols=True, leave=True)


def _mib(n):
    return n / 2**20


def run_forecast(settings, out=print):
    """Run the whole job of :class:`ForecastSettings`; print progress and one summary line; return 0.

    Collective over ``MPI.COMM_WORLD``: call on every rank with the same settings. Raises ValueError alike on
    every rank for settings or data that cannot work.
    """
    job = _Job(settings, out)
    manager = job.manager
    try:
        started = time.perf_counter()
        job.open_data()
        name = job.model_name()
        resumed = job.load(settings.resume, name) if settings.resume else None
        statistics = resumed["statistics"] if resumed else job.statistics()
        job.samples(statistics)
        if settings.estimate:
            return _estimate(job, name)
        model = job.build_model(name)
        optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
        first = 1
        if resumed:
            model.load_state_dict(resumed["model"])
            optimizer.load_state_dict(resumed["optimizer"])
            job.losses, first = list(resumed["losses"]), resumed["step"] + 1
        groups = manager.data_parallel_size
        layout = "x".join(map(str, settings.domain_shape(job.size)))
        if job.rank == 0:
            out(f"mpidomain forecast: {job.size} ranks = {groups} data-parallel group(s) x D={layout} "
                f"({'tiles' if manager.tiled else 'latitude slabs'}); {name} model, {settings.dtype}; "
                f"{len(job.channels)} channels ({', '.join(job.channels)}) on {job.data.sizes[LAT]} x "
                f"{job.data.sizes[LON]}; data {job.data_path}")
        loss_function = LatitudeWeightedMSE(job.latitude, manager)
        last = settings.stop_after or settings.steps
        checkpoint = os.path.join(job.folder, "checkpoint.pt")
        model.train()
        with _progress(job, last, "train", initial=first - 1) as bar:
            for step in range(first, last + 1):
                began = time.perf_counter()
                job.losses.append(job.train_step(model, optimizer, loss_function, step))
                job.step_seconds.append(job.world.allreduce(time.perf_counter() - began, op=mpi().MAX))
                bar.set_postfix_str(f"loss {job.losses[-1]:.4g}, rollout {job.rollout_of(step)}")
                bar.update(1)
        job.save(checkpoint, model, optimizer, last, name, statistics)
        if job.rank == 0:
            out(f"checkpoint after step {last}: {checkpoint}")
        rmse = None
        if settings.stop_after is None:
            # The forecast runs from the checkpoint on disk, as a later job would: a fresh model, its weights loaded.
            forecaster = job.build_model(name)
            forecaster.load_state_dict(job.load(checkpoint, name)["model"])
            path = os.path.join(job.folder, "forecast.zarr")
            if job.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            _barrier(job.world, "forecast: clearing the forecast store")
            if manager.dp_rank == 0:
                rmse = job.forecast(forecaster, path)
            _barrier(job.world, "forecast: the forecast")
            if job.rank == 0:
                _report(job, rmse, path)
            if settings.plot:
                from .plot import draw

                if job.rank == 0:
                    draw(settings.plot, job, path)
                    out(f"picture: {settings.plot}")
        _summary(job, name, layout, time.perf_counter() - started)
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


def _summary(job, name, layout, seconds):
    peak = job.world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, op=mpi().MAX)
    read = job.world.allreduce(job.store.bytes_read, op=mpi().MAX)
    written = job.world.allreduce(job.written, op=mpi().MAX)
    if job.rank == 0:
        steps = job.step_seconds
        per_step = float(np.median(steps)) if steps else math.nan
        job.print(f"forecast {'stopped' if job.settings.stop_after else 'done'}: {name} {job.settings.dtype}, D={layout} x "
                  f"{job.manager.data_parallel_size} group(s); loss {job.losses[0]:.6g} -> {job.losses[-1]:.6g} after "
                  f"{len(job.losses)} steps; {per_step:.3f} s/step; peak {_mib(peak):.0f} MiB/rank; "
                  f"read {_mib(read):.2f} MiB/rank, wrote {_mib(written):.2f} MiB/rank; {seconds:.1f} s")


def _estimate(job, name):
    """Print what one training step's forward saves for backward on the largest rank, predicted before any
    activation exists (:func:`mpidomain.nn.estimate_memory`), for this layout and for one process."""
    settings = job.settings
    per_group = settings.batch // job.manager.data_parallel_size
    shape = (per_group, len(job.channels), job.data.sizes[LAT], job.data.sizes[LON])
    estimate = estimate_memory(job.single_model(name), shape, job.manager, custom_converters=custom_converters)
    if job.rank == 0:
        job.print(f"estimate for {name} {settings.dtype}, batch {per_group} per domain group: {estimate}")
        job.print(f"training steps save {estimate.bytes_per_rank / 2**20:.1f} MiB per rank, the "
                  f"{settings.train_rollout}-step fine-tuning "
                  f"{settings.train_rollout * estimate.bytes_per_rank / 2**20:.1f} MiB (each step of a rollout "
                  "saves as much again)")
    return 0

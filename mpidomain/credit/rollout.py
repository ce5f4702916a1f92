"""CREDIT's gen2 forecasts (``credit rollout``) on tiles: :func:`rollout`.

What CREDIT 2026.2.0's ``credit rollout`` (``applications/rollout_gen2.py``, ``run_forecast``) does, with
no rank holding a whole field: the init times go round the data-parallel groups (CREDIT's
``range(rank, n, world)`` over groups instead of ranks); each domain group rolls its forecasts out on
tiles. Step 1 runs the model on the initial condition (prognostics, statics and dynamic forcing at the
init time, each rank reading its tile); step ``k + 1`` on step ``k``'s prediction in physical units (the
per-step postblocks' ``y_processed``) normalised again by the per-step preblocks, the dynamic forcing read
by tile at ``init + k * timestep``, the statics of step 1; the diagnostics are not fed back; the model in
``eval()`` under ``no_grad``. No field is gathered between steps: each step's physical tile goes to
:class:`~mpidomain.credit.output.ForecastWriter` (CREDIT's files) and, where the data files hold the
valid time, with the truth's tile to :class:`~mpidomain.credit.scores.ForecastScores`.

Before any file is written, every mistake is one error on every rank: the config's inference block
(:mod:`.inference_settings`), blocks not applied by tile, init times whose inputs the data lacks, a
checkpoint that is missing or holds another model, output settings (a variable the model does not
predict), a folder that cannot be written, a climatology that does not fit.
"""

import os
import pickle
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

import numpy as np
import pandas as pd
import torch

from .._agreement import agree
from .._errors import raised_alike
from ..command import UsageError, agreed, decided, probe_writable
from ..manager import library_comm
from .blocks import Blocks, channel_layouts
from .config import check_blocks, read_data
from .dataset import CreditTileDataset, plan_source
from .files import index_files
from ..nn import TrainingOptions, prepare_training
from .model import build_model
from .output import ForecastWriter, OutputVariable
from .post_conf import model_fixers
from .scores import ClimatologyMean, ForecastScores, read_climatology
from .trainer import assemble_inputs

__all__ = ["RolloutOptions", "RolloutSummary", "rollout", "rollout_config", "default_checkpoint", "load_weights",
           "CLIMATOLOGY_CHOICES"]

#: ``--climatology``'s words (anything else is a file's path).
CLIMATOLOGY_CHOICES = ("auto", "mean", "validation", "none")


@dataclass(frozen=True)
class RolloutOptions:
    """The command line's choices beyond the config.

    :param checkpoint: The weights' file; None: CREDIT's choice (:func:`default_checkpoint`).
    :param climatology: ACC's climatology: ``auto`` (the ``era5_normalizer`` mean file if the config has
        one, else the validation period's mean, else none), ``mean``, ``validation``, ``none`` or a file's path.
    :param scores: The scores' CSV file; None: ``<save_forecast>/scores.csv``.
    :param compile: Compile the model (``torch.compile``, :func:`mpidomain.nn.prepare_training`).
    :param amp: ``"bf16"``: run the model under ``torch.autocast`` to bfloat16 (its output back in float32 before
        the postblocks); None: the model's dtype.
    :param compile_backend: ``torch.compile``'s backend with ``compile`` (no option: ``"aot_eager"`` for tests).
    :param rng: How the converted model's random layers draw (:mod:`mpidomain.nn.rng`); the rollout runs the
        model in eval mode (as CREDIT's), where dropout draws nothing.
    """

    checkpoint: Optional[str] = None
    climatology: str = "auto"
    scores: Optional[str] = None
    compile: bool = False
    amp: Optional[str] = None
    compile_backend: str = "inductor"
    rng: str = "tile"

    def stack(self):
        """The :class:`~mpidomain.nn.TrainingOptions` of ``compile`` and ``amp`` (no backward to checkpoint for)."""
        return TrainingOptions(compile=self.compile, amp=self.amp, compile_backend=self.compile_backend)


@dataclass(frozen=True)
class RolloutSummary:
    """What a rollout did, alike on every rank but ``forecasts``, ``files``, ``bytes_read`` and ``seconds``
    (this rank's group's, this rank's)."""

    forecasts: Tuple[Any, ...]     # this data-parallel group's init times
    files: Tuple[str, ...]         # the files this group completed
    table: Any                     # scores.ScoreTable of every group's forecasts
    scores_csv: str
    climatology: str               # what ACC's climatology was, in words
    unscored: Tuple[Any, ...]      # valid times past the data (written, not scored)
    checkpoint: str
    bytes_read: int                # values this rank read (inputs, forcing, truth)
    seconds: float                 # this rank's time in the steps (model, blocks, reads, writes, scores)


def rollout_config(conf, settings):
    """Return ``conf`` as ``credit rollout`` runs it: ``inference.data``, ``preblocks`` and ``postblocks``
    replacing the top level's (CREDIT's ``apply_inference_overrides``), ``save_loc`` expanded. Pure."""
    out = dict(conf)
    out["data"] = dict(settings.data)
    out["preblocks"] = settings.preblocks
    out["postblocks"] = settings.postblocks
    if isinstance(conf.get("save_loc"), str):
        out["save_loc"] = os.path.expandvars(conf["save_loc"])
    return out


def default_checkpoint(conf):
    """CREDIT's choice of weights: ``save_loc/model_checkpoint.pt`` if it exists, else ``save_loc/checkpoint.pt``.

    Local (looks at the file system). Raises :class:`UsageError` where the config has no ``save_loc``.
    """
    save_loc = conf.get("save_loc")
    if not isinstance(save_loc, str) or not save_loc:
        raise UsageError("save_loc is required to find the checkpoint (save_loc/model_checkpoint.pt or "
                         "checkpoint.pt, as credit rollout looks for it), or give --checkpoint PATH")
    save_loc = os.path.expandvars(save_loc)
    preferred = os.path.join(save_loc, "model_checkpoint.pt")
    return preferred if os.path.isfile(preferred) else os.path.join(save_loc, "checkpoint.pt")


def _first_line(error):
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def load_weights(comm, model, path):
    """Load the weights of the checkpoint ``path`` into ``model`` (a converted model keeps CREDIT's names).

    Collective over ``comm`` (every rank reads the file). CREDIT's ``credit rollout`` loads with
    ``strict=False``: a name the model lacks or a shape that differs raises a traceback there, a weight the
    checkpoint lacks keeps its random initial value with a warning. Here any of the three is one
    :class:`UsageError` on every rank naming them, so a forecast never runs with weights of another model or
    with random ones. The file may be CREDIT's (``model_state_dict``, or a bare state dict) or ``credit
    train``'s, written at any layout.
    """
    def load():
        if not os.path.isfile(path):
            raise UsageError(f"checkpoint {path}: no such file; train first (credit train or python -m mpidomain "
                             "credit train write save_loc/checkpoint.pt) or give --checkpoint PATH")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise UsageError(f"checkpoint {path}: cannot be read ({type(error).__name__}: {_first_line(error)}); "
                             "give a checkpoint.pt that credit train saved") from None
        weights = state.get("model_state_dict", state) if isinstance(state, dict) else None
        if not isinstance(weights, dict) or not all(torch.is_tensor(v) for v in weights.values()):
            raise UsageError(f"checkpoint {path}: holds no model weights (a model_state_dict of tensors); give a "
                             "checkpoint.pt that credit train saved")
        ours = model.state_dict()
        unexpected = [k for k in weights if k not in ours]
        missing = [k for k in ours if k not in weights]
        shapes = [k for k in ours if k in weights and tuple(weights[k].shape) != tuple(ours[k].shape)]
        if unexpected or missing or shapes:
            parts = []
            if unexpected:
                parts.append(f"{len(unexpected)} weights the model lacks (e.g. {unexpected[0]})")
            if missing:
                parts.append(f"{len(missing)} of the model's weights missing (e.g. {missing[0]})")
            if shapes:
                key = shapes[0]
                parts.append(f"{len(shapes)} of other shapes (e.g. {key}: {tuple(weights[key].shape)} in the "
                             f"checkpoint, {tuple(ours[key].shape)} in the model)")
            raise UsageError(f"checkpoint {path} holds another model than the config's model block: "
                             f"{'; '.join(parts)}; roll out with the config that trained it (a checkpoint of "
                             "CREDIT's own domain-parallel trainer has renamed weights)")
        model.load_state_dict(weights, strict=True)
    agreed(comm, "credit rollout: loading the checkpoint", load)


# -- which times the forecasts read ------------------------------------------------------------------------------

def _needed_times(data, init_times, steps):
    """``{kind: times}`` the inputs read (statics: None) and the valid times, for ``init_times``; pure."""
    dt = pd.Timedelta(data.timestep)
    window = [k * dt for k in range(data.history_len - 1, -1, -1)]
    prognostic, forcing = set(), set()
    for init in init_times:
        history = [init - lag for lag in window]
        prognostic.update(history)
        forcing.update(history + [init + s * dt for s in range(1, steps)])
    valid = sorted({init + s * dt for init in init_times for s in range(1, steps + 1)})
    inputs = {"prognostic": sorted(prognostic), "dynamic_forcing": sorted(forcing)}
    return inputs, valid


class _Times:
    """The times each field's files hold, read from their time coordinates (world rank 0 only)."""

    def __init__(self, data):
        import xarray as xr

        self._xr, self._data, self._files, self._times = xr, data, {}, {}

    def index(self, field):
        if field.kind not in self._files:
            self._files[field.kind] = index_files(field.path, field.time_format)
        return self._files[field.kind]

    def _file_times(self, path):
        if path not in self._times:
            with self._xr.open_dataset(path, engine=self._data.engine, cache=False) as ds:
                coord = self._data.time_coord
                self._times[path] = set(pd.DatetimeIndex(ds[coord].values)) if coord in ds.coords else set()
        return self._times[path]

    def holds(self, field, time):
        """None if ``field``'s files hold ``time``, else why not (a phrase)."""
        index = self.index(field)
        try:
            path = index.find(time)
        except ValueError:
            return f"no file of {field.path} holds ({self._span(field)})"
        if pd.Timestamp(time) not in self._file_times(path):
            return f"{path} lacks ({self._span(field)})"
        return None

    def _span(self, field):
        """The first and last times of ``field``'s files, in words."""
        paths = self.index(field).paths()
        first, last = self._file_times(paths[0]), self._file_times(paths[-1])
        if not first or not last:
            return "its files have no times"
        return f"its files hold {min(first):%Y-%m-%d %H:%M} to {max(last):%Y-%m-%d %H:%M}"


def _check_times(comm, data, init_times, steps, key):
    """Check that the data holds every input the forecasts read; return the valid times whose truth it holds.

    Collective over ``comm``: world rank 0 looks at the files' times, every rank gets the verdict. A missing
    input raises :class:`UsageError` alike on every rank, naming the forecast, the field, the time and ``key``
    (the config key of the init times).
    """
    inputs, valid = _needed_times(data, init_times, steps)

    def work():
        times = _Times(data)
        dt = pd.Timedelta(data.timestep)
        for init in init_times:
            reads = [(kind, init - k * dt) for kind in ("prognostic", "dynamic_forcing")
                     for k in range(data.history_len - 1, -1, -1)]
            reads += [("dynamic_forcing", init + s * dt) for s in range(1, steps)]
            for kind, when in reads:
                field = data.field(kind)
                if field is None:
                    continue
                why = times.holds(field, when)
                if why is not None:
                    names = ", ".join(field.vars_3d + field.vars_2d)
                    raise UsageError(f"{key}: the forecast from {init:%Y-%m-%d %H:%M} reads {kind} ({names}) at "
                                     f"{when:%Y-%m-%d %H:%M}, which {why}; choose init "
                                     "times whose inputs the data holds")
        targets = [field for field in (data.field("prognostic"), data.field("diagnostic")) if field is not None]
        return [when for when in valid if all(times.holds(field, when) is None for field in targets)]
    scored = decided(comm, "credit rollout: the init times' data", work)
    return set(comm.bcast(scored, root=0)), inputs


# -- the climatology ---------------------------------------------------------------------------------------------

def _mean_file(conf):
    """The first ``era5_normalizer`` preblock's ``mean_path``, or None."""
    for block in (((conf.get("preblocks") or {}).get("per_step")) or {}).values():
        if isinstance(block, dict) and block.get("type") == "era5_normalizer":
            return (block.get("args") or {}).get("mean_path")
    return None


def _validation_block(conf, data_block):
    """The ``validation_data`` block (its missing keys the rollout data's), or None."""
    block = conf.get("validation_data")
    if not isinstance(block, dict):
        return None
    merged = dict(data_block)
    merged.update({k: v for k, v in block.items() if k not in ("forecast_len",)})
    return merged


def _climatology_choice(choice, conf, data_block):
    """``(kind, detail)``: what ``--climatology choice`` means for this config (kind: none, mean, validation,
    file)."""
    if choice == "auto":
        if _mean_file(conf):
            return "mean", _mean_file(conf)
        if _validation_block(conf, data_block) is not None:
            return "validation", None
        return "none", None
    if choice == "mean":
        if not _mean_file(conf):
            raise UsageError("--climatology mean: the config has no era5_normalizer preblock whose mean_path holds "
                             "the means; give a climatology file, validation or none")
        return "mean", _mean_file(conf)
    if choice == "validation":
        if _validation_block(conf, data_block) is None:
            raise UsageError("--climatology validation: the config has no validation_data block; give a "
                             "climatology file, mean or none")
        return "validation", None
    if choice == "none":
        return "none", None
    return "file", os.path.expandvars(choice)


# -- the run ------------------------------------------------------------------------------------------------------

@dataclass
class _Setup:
    """Everything a rollout needs, built and checked on every rank before any file is written."""

    settings: Any
    data: Any
    plan: Any
    blocks: Any
    model: Any
    device: Any
    variables: Tuple[OutputVariable, ...]
    writer: Any
    scores: Any
    scores_csv: str
    climatology: str
    scored: set
    checkpoint: str
    autocast: Any
    fix: Any  # model.post_conf's fixers (mpidomain.credit.post_conf.model_fixers)


def _output_variables(target_layout, source_levels):
    """The target layout as :class:`OutputVariable` s: a 3-D variable's levels are the config's (CREDIT's level
    coordinate), else 0, 1, ..."""
    variables = []
    for key, levels, _ in target_layout:
        three_d = len(key.split("/")) > 2 and key.split("/")[2] == "3d"
        if not three_d:
            variables.append(OutputVariable(key))
            continue
        values = tuple(source_levels) if source_levels and len(source_levels) == levels else tuple(range(levels))
        variables.append(OutputVariable(key, values))
    return tuple(variables)


def _data_block(settings):
    """The rollout's data block: CREDIT's derived start and end where absent, ``forecast_len`` its steps."""
    block = dict(settings.data)
    if "start_datetime" not in block:
        block["start_datetime"] = str(min(settings.init_times))
    if "end_datetime" not in block:
        block["end_datetime"] = str(max(settings.init_times) + settings.steps * settings.timestep)
    block["forecast_len"] = settings.steps
    block.pop("data_clamp", None)  # a training key: credit rollout does not clamp the inputs
    return block


def _prepare(conf, settings, options, manager, say):
    from credit.seed import seed_everything

    world = library_comm(manager, "world")
    rconf = rollout_config(conf, settings)
    where = "inference.data" if "data" in settings.overridden else "data"
    block = _data_block(settings)
    model_conf = conf.get("model") if isinstance(conf.get("model"), dict) else {}
    if "type" not in model_conf:
        raise raised_alike(UsageError(f"model.type = {model_conf.get('type')!r}: required: the model CREDIT's loader "
                                      "builds (e.g. wxformer)"))
    try:
        data = read_data(block, where, model_conf.get("levels"))
        check_blocks(rconf)
    except UsageError as error:  # every rank read the same config
        raise raised_alike(error) from None
    key = {"single": "inference.single_forecast.start_datetime"}.get(settings.run_mode, "inference.batch_forecast")
    scored, inputs = _check_times(world, data, settings.init_times, settings.steps, key)
    needed = dict(inputs, prognostic=sorted(set(inputs["prognostic"]) | scored), diagnostic=sorted(scored))
    kind, detail = agreed(world, "credit rollout: --climatology",
                          lambda: _climatology_choice(options.climatology, conf, block))
    blocks_data = [data]
    valid = None
    if kind == "validation":
        valid_block = _validation_block(conf, block)
        try:
            valid = replace(read_data(valid_block, "validation_data", model_conf.get("levels")), source=data.source)
        except UsageError as error:
            raise raised_alike(error) from None
        period = pd.date_range(pd.Timestamp(valid.start), pd.Timestamp(valid.end), freq=pd.Timedelta(valid.timestep))
        blocks_data.append(valid)
        needed = (needed, {"prognostic": list(period), "diagnostic": list(period)})
    else:
        needed = (needed,)
    shape = (model_conf.get("image_height"), model_conf.get("image_width"))
    plans = plan_source(world, tuple(blocks_data), manager, shape if None not in shape else None, needed=needed)
    plan = plans[0]
    layouts = agreed(world, "credit rollout: the channel layout", lambda: channel_layouts(conf, saved=True))
    blocks = agreed(world, "credit rollout: the pre- and postblocks",
                    lambda: Blocks(rconf, _BlockSettings(data), layouts=layouts))
    fix, fixing = agreed(world, "credit rollout: model.post_conf",
                         lambda: model_fixers(model_conf, [key for key, _, _ in blocks.target_layout]))
    if fixing:
        say(fixing)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    seed_everything(int(conf.get("seed", 42)))  # as credit rollout: the weights come from the checkpoint anyway
    model = agreed(world, "credit rollout: building the model",
                   lambda: build_model(rconf, manager, device, options.rng))
    path = options.checkpoint if options.checkpoint else agreed(world, "credit rollout: the checkpoint",
                                                                lambda: default_checkpoint(conf))
    path = os.path.expandvars(path)
    load_weights(world, model, path)
    model.eval()
    source = next(iter(settings.data["source"].values())) or {}
    variables = _output_variables(blocks.target_layout, source.get("levels"))
    latitude, longitude = np.asarray(plan.latitude), np.asarray(plan.longitude)
    writer = ForecastWriter(settings.output, variables, latitude, longitude, settings.save_forecast,
                            steps=settings.steps, step_hours=settings.step_hours, calendar=settings.calendar,
                            manager=manager)
    scores_csv = os.path.expandvars(options.scores) if options.scores else \
        os.path.join(settings.save_forecast, "scores.csv")
    decided(world, "credit rollout: --scores", lambda: _probe_folder(scores_csv))
    climatology, words = None, "none: no ACC"
    if kind in ("mean", "file"):
        try:
            climatology = read_climatology(detail, variables, latitude, longitude, manager)
        except ValueError as error:  # raised alike on every rank by read_climatology's agreement
            raise raised_alike(UsageError(f"--climatology {options.climatology}: {_first_line(error)}; give a "
                                          "file with the predicted variables on the data's grid, validation or "
                                          "none")) from None
        words = f"{'the era5_normalizer means' if kind == 'mean' else 'the file'} {detail}"
    elif kind == "validation":
        climatology = _validation_mean(plans[1], variables, blocks.target_layout, manager)
        words = (f"the mean of validation_data's {len(period)} times ({period[0]:%Y-%m-%d %H:%M} to "
                 f"{period[-1]:%Y-%m-%d %H:%M})")
    scores = ForecastScores(variables, latitude, longitude, manager, climatology=climatology)
    prepared = prepare_training(model, options.stack(), manager=manager)  # --compile, --amp (local)
    return _Setup(settings, data, plan, blocks, prepared.model, device, variables, writer, scores, scores_csv, words,
                  scored, path, prepared.autocast, fix)


@dataclass(frozen=True)
class _BlockSettings:
    """What :class:`~mpidomain.credit.blocks.Blocks` reads of the settings: the data block (no clamp)."""

    data: Any


def _probe_folder(path):
    """Make the folder of the file ``path`` and check that it can be written (OSError otherwise)."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        probe_writable(folder)
    except OSError as error:
        raise UsageError(f"--scores {path}: its folder cannot be written ({error.strerror or error}); give a file "
                         "in a folder this job can write") from None


def _truth(dataset, target_layout, when):
    """The truth's tile at ``when``: the target layout's channels, (C, h, w) float32, and the bytes read."""
    read, total = {}, 0
    for kind in ("prognostic", "diagnostic"):
        if dataset.plan.data.field(kind) is None:
            continue
        values, nbytes = dataset.read(kind, [when])
        read.update(values)
        total += nbytes
    return torch.cat([read[key][:, 0] for key, _, _ in target_layout], dim=0).numpy(), total


def _validation_mean(plan, variables, target_layout, manager):
    """The mean of the truth's tiles over the validation period (each rank its tile: local reads)."""
    dataset = CreditTileDataset(plan, return_target=False)
    mean = ClimatologyMean(variables)
    period = pd.date_range(pd.Timestamp(plan.data.start), pd.Timestamp(plan.data.end),
                           freq=pd.Timedelta(plan.data.timestep))
    error = None
    try:
        for when in period:
            mean.add(_truth(dataset, target_layout, when)[0])
    except (OSError, ValueError, KeyError) as exc:
        error = UsageError(f"validation_data: reading the truth for the climatology failed ({type(exc).__name__}: "
                           f"{_first_line(exc)})")
    finally:
        dataset.close()
    agree(library_comm(manager, "world"), "credit rollout: the validation climatology", None, error=error)
    return mean.climatology()


def _batched(tensors, device):
    return {k: v[None].to(device) for k, v in tensors.items()}


def rollout(conf, settings, options, manager, say=print):
    """Run the forecasts of ``conf``'s inference block (``settings``, :class:`~mpidomain.credit.inference_settings.
    InferenceSettings`) on ``manager``'s layout; return a :class:`RolloutSummary`.

    Collective over every rank of the job (the manager's world): call on every rank with the same arguments.
    Every mistake in the config, the data, the checkpoint or the output settings raises the same
    :class:`~mpidomain.command.UsageError` on every rank before any file is written. The init times go round
    the data-parallel groups; each domain group writes its forecasts' files (CREDIT's names and layout) and
    every rank gets the same score table, also written to ``options.scores`` (a CSV).
    """
    world = library_comm(manager, "world")
    setup = _prepare(conf, settings, options, manager, say)
    source = setup.data.source
    dt = settings.timestep
    mine = settings.init_times[manager.dp_rank::manager.data_parallel_size]
    dataset = CreditTileDataset(setup.plan, return_target=False)
    layout = setup.blocks.target_layout
    history_len = setup.data.history_len
    read_bytes, seconds = 0, 0.0
    say(f"credit rollout: {len(settings.init_times)} forecast(s) of {settings.steps} steps ({settings.step_hours} h) "
        f"over {manager.data_parallel_size} group(s); weights {setup.checkpoint}; ACC climatology: "
        f"{setup.climatology}; writing under {settings.save_forecast}")
    try:
        with torch.no_grad():
            for number, init in enumerate(mine, 1):
                began = time.perf_counter()
                sample = dataset[(init, 0)]
                read_bytes += int(sample["metadata"][source]["bytes"])
                ic_raw = _batched(sample["input"][source], setup.device)
                del sample
                x, _ = setup.blocks.pre(ic_raw)
                files = 0
                # Each step holds its input, the prediction and what the step reads; what the next step does not
                # need is let go as soon as it is used, so no two steps' fields are alive at once.
                for step in range(1, settings.steps + 1):
                    with setup.autocast():
                        y_pred = setup.model(x)
                    y_pred = y_pred.float()  # under --amp bf16, the postblocks and files in float32 as without
                    if history_len == 1:
                        del x
                    if y_pred.dim() == 5:
                        y_pred = y_pred.flatten(1, 2)
                    prediction = setup.fix(setup.blocks.post({"y_pred": y_pred})["y_processed"])
                    del y_pred
                    values = torch.cat([prediction[key] for key, _, _ in layout], dim=1)[0, :, 0]
                    values = values.float().cpu().numpy()
                    if setup.writer.write(values, init, step) is not None:
                        files += 1
                    valid = init + step * dt
                    if valid in setup.scored:
                        truth, nbytes = _truth(dataset, layout, valid)
                        read_bytes += nbytes
                        setup.scores.add(values, truth, init, step * settings.step_hours)
                        del truth
                    del values
                    if step == settings.steps:
                        break
                    forcing = dataset[(init + step * dt, step)]
                    read_bytes += int(forcing["metadata"][source]["bytes"])
                    inputs = assemble_inputs(ic_raw, prediction, _batched(forcing["input"][source], setup.device),
                                             history_len)
                    del prediction, forcing
                    newest, _ = setup.blocks.pre(inputs)
                    del inputs
                    # history_len > 1: slide the window, the oldest time out, the newest in
                    x = newest if history_len == 1 else torch.cat([x[:, :, 1:], newest[:, :, -1:]], dim=2)
                    del newest
                seconds += time.perf_counter() - began
                if world.Get_rank() == 0:
                    say(f"forecast from {init:%Y-%m-%d %H:%M} ({number} of {len(mine)} on group 0): "
                        f"{settings.steps} steps, {files} file(s), {time.perf_counter() - began:.1f} s")
    finally:
        dataset.close()
    files = setup.writer.finish()
    table = setup.scores.finish(setup.scores_csv)
    valid_times = {init + s * dt for init in settings.init_times for s in range(1, settings.steps + 1)}
    unscored = tuple(sorted(valid_times - setup.scored))
    return RolloutSummary(tuple(mine), tuple(files), table, setup.scores_csv, setup.climatology, unscored,
                          setup.checkpoint, read_bytes, seconds)

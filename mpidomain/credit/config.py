"""A CREDIT gen2 config read as CREDIT 2026.2.0 reads it: :func:`read_settings`.

Pure: no torch, no CREDIT, no files but the YAML itself. Every key CREDIT's
``credit train`` acts on is either honoured (it lands in :class:`TrainSettings`)
or refused with one line naming the key, its value and the fix (:class:`~mpidomain.command.UsageError`,
raised alike on every rank: every rank reads the same file). Keys CREDIT itself
ignores are accepted, as CREDIT accepts them.
"""

import os
import re
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from ..command import UsageError

__all__ = ["FieldSettings", "DataSettings", "TrainSettings", "load_config", "read_settings", "read_data",
           "check_blocks", "parse_domain", "FIELD_KINDS", "TRAINER_TYPES"]

FIELD_KINDS = ("prognostic", "diagnostic", "dynamic_forcing", "static")
TRAINER_TYPES = ("gen2", "era5-gen2")
PREBLOCK_TYPES = ("era5_normalizer", "bridgescaler_transform", "concat", "to_device")
POSTBLOCK_TYPES = ("reconstruct", "bridgescaler_transform")
METRIC_TYPES = ("rmse", "mse", "mae", "bias", "r2score")
LOSS_BASE_WEIGHTINGS = ("inverse_variance", "manual", "none", "learnable")
# CREDIT's ensemble losses that score the members along the batch axis (trainer.ensemble_size > 1): pointwise
# in space, so each rank scores its tile. ring-crps (one member per data-parallel rank) is not among them.
ENSEMBLE_LOSSES = ("KCRPS", "almost-fair-crps")
_STRFTIME = re.compile(r"%[YmdHMSj]")


@dataclass(frozen=True)
class FieldSettings:
    """One field type of a source: its 3-D and 2-D variables and where its files are."""

    kind: str
    vars_3d: Tuple[str, ...]
    vars_2d: Tuple[str, ...]
    path: str
    time_format: Optional[str]

    def keys(self, source):
        """CREDIT's variable keys ``source/kind/3d|2d/name``, 3-D first, in config order."""
        return tuple(f"{source}/{self.kind}/3d/{v}" for v in self.vars_3d) + \
            tuple(f"{source}/{self.kind}/2d/{v}" for v in self.vars_2d)


@dataclass(frozen=True)
class DataSettings:
    """A ``data`` (or ``validation_data``) block: one local source, its clock and its rollout."""

    source: str
    fields: Tuple[FieldSettings, ...]
    level_coord: str
    levels: Optional[Tuple[float, ...]]
    time_coord: str
    engine: Optional[str]
    start: str
    end: str
    timestep: str
    history_len: int
    forecast_len: int
    clamp: Optional[Tuple[float, float]]

    def field(self, kind):
        """The :class:`FieldSettings` of ``kind``, or None where the config has none."""
        return next((f for f in self.fields if f.kind == kind), None)


@dataclass(frozen=True)
class TrainSettings:
    """Everything ``credit train`` reads from a config, checked; ``conf`` is the config itself (CREDIT's own
    loaders take it: the model, the scheduler, the loss weights)."""

    conf: dict
    data: DataSettings
    valid: DataSettings
    save_loc: str
    seed: int
    domain: tuple  # (D,) latitude slabs or (D_lat, D_lon) tiles
    data_mode: str
    batch: int
    valid_batch: int
    batches_per_epoch: int
    valid_batches_per_epoch: int
    start_epoch: int
    epochs: int
    num_epoch: int
    backprop_on_timestep: Tuple[int, ...]
    grad_accum_every: int
    grad_max_norm: object  # float, or "dynamic"
    amp: bool
    activation_checkpoint: bool
    compile: bool
    use_ema: bool
    ema_decay: float
    thread_workers: int
    valid_thread_workers: int
    prefetch_factor: int
    skip_validation: bool
    skip_nan_prune: bool
    use_scheduler: bool
    scheduler_type: str
    load_weights: bool
    load_optimizer: bool
    load_scaler: bool
    load_scheduler: bool
    reload_epoch: bool
    update_learning_rate: bool
    save_backup_weights: bool
    save_best_weights: bool
    save_every_epoch: bool
    stopping_patience: int
    ensemble_size: int  # members per sample along the batch axis (1: none)
    stop_after_epoch: bool
    train_one_epoch: bool
    training_metric: str
    direction: str
    save_metric_vars: object
    use_tensorboard: bool
    learning_rate: float
    weight_decay: float

    @property
    def groups(self):
        """Ranks per domain group."""
        size = 1
        for d in self.domain:
            size *= d
        return size


def load_config(path):
    """Read the YAML config at ``path`` as CREDIT does (PyYAML's FullLoader); return the dict. Local.

    A missing or unreadable file, or one that is not a mapping, raises :class:`UsageError`.
    """
    import yaml

    try:
        with open(path) as file:
            conf = yaml.load(file, Loader=yaml.FullLoader)
    except OSError as error:
        raise UsageError(f"-c {path}: cannot read the config ({error.strerror or error}); give a CREDIT gen2 "
                         "config file") from None
    except yaml.YAMLError as error:
        raise UsageError(f"-c {path}: not valid YAML ({str(error).splitlines()[0]})") from None
    if not isinstance(conf, dict):
        raise UsageError(f"-c {path}: the config is a {type(conf).__name__}, not a mapping of CREDIT's sections")
    return conf


def parse_domain(value, where="trainer.parallelism.domain"):
    """Return ``value`` (4, "4", "2x2", [2, 2]) as ``(D,)`` or ``(D_lat, D_lon)``; UsageError otherwise. Pure."""
    parts = None
    if isinstance(value, bool):
        parts = None
    elif isinstance(value, int):
        parts = (value,)
    elif isinstance(value, str):
        try:
            parts = tuple(int(p) for p in value.lower().split("x"))
        except ValueError:
            parts = None
    elif isinstance(value, (list, tuple)):
        parts = tuple(value) if all(isinstance(p, int) and not isinstance(p, bool) for p in value) else None
    if not parts or len(parts) > 2 or min(parts) < 1:
        raise UsageError(f"{where} = {value!r}: expected a rank count such as 4 or tiles such as 2x2")
    return parts


class _Reader:
    """Reads a config, collecting one line per refused key."""

    def __init__(self, conf):
        self.conf = conf
        self.problems = []

    def refuse(self, key, value, why):
        self.problems.append(f"{key} = {value!r}: {why}")

    def get(self, section, key, default=None, kind=None, where=None):
        value = section.get(key, default) if isinstance(section, dict) else default
        if value is None:
            return default
        if kind is not None and not _is(value, kind):
            self.refuse(f"{where}.{key}" if where else key, value, f"expected {_kind_name(kind)}")
            return default
        return value


def _is(value, kind):
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def _kind_name(kind):
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            list: "a list"}.get(kind, str(kind))


def _time_format(reader, where, field):
    path = field.get("path")
    given = field.get("filename_time_format")
    if not isinstance(path, str) or not path:
        reader.refuse(f"{where}.path", path, "expected the path template of the field's files, e.g. "
                      "/data/era5_%Y.nc (one file for static fields)")
        return None
    codes = _STRFTIME.findall(path)
    if given is not None and not isinstance(given, str):
        reader.refuse(f"{where}.filename_time_format", given, "expected a strftime format such as %Y")
        return None
    if codes:
        first = min(path.find(c) for c in codes)
        last = max(path.rfind(c) + 2 for c in codes)
        template_format = path[first:last]
        if given is not None and given != template_format:
            reader.refuse(f"{where}.filename_time_format", given,
                          f"the path template {path} already says {template_format!r}; drop the key or make them agree")
        return template_format
    return given


def _data(reader, block, where, model_levels):
    """The :class:`DataSettings` of a ``data``-shaped block (None after a refusal)."""
    if not isinstance(block, dict):
        reader.refuse(where, block, "expected a mapping with source, start_datetime, end_datetime, timestep, "
                      "forecast_len")
        return None
    sources = block.get("source")
    if not isinstance(sources, dict) or not sources:
        reader.refuse(f"{where}.source", sources, "expected one source, e.g. ERA5: {dataset_type: local, ...}")
        return None
    if len(sources) > 1:
        reader.refuse(f"{where}.source", list(sources), "mpidomain credit train reads one source; merge the "
                      "sources' variables into one (several files per field type are fine)")
    name, source = next(iter(sources.items()))
    here = f"{where}.source.{name}"
    if not isinstance(source, dict):
        reader.refuse(here, source, "expected a mapping with dataset_type, variables, levels")
        return None
    if source.get("dataset_type") != "local":
        reader.refuse(f"{here}.dataset_type", source.get("dataset_type"),
                      "mpidomain reads local netCDF/Zarr files by tile: dataset_type local")
    if source.get("mode", "local") != "local":
        reader.refuse(f"{here}.mode", source.get("mode"), "only local files are read by tile")
    if source.get("temporal_mode", "exact") != "exact":
        reader.refuse(f"{here}.temporal_mode", source.get("temporal_mode"), "only exact times (the default) are read")
    for key in ("date_ranges", "start_datetime", "end_datetime", "timestep", "history_len", "forecast_len"):
        if key in source:
            reader.refuse(f"{here}.{key}", source[key], f"set {key} in the {where} block, for every field alike")
    for key in ("calendar",):
        if source.get(key, "standard") not in ("standard", "gregorian", "proleptic_gregorian"):
            reader.refuse(f"{here}.{key}", source[key], "only the standard calendar is read")
    if block.get("calendar", "standard") not in ("standard", "gregorian", "proleptic_gregorian"):
        reader.refuse(f"{where}.calendar", block["calendar"], "only the standard calendar is read")
    if "date_ranges" in block:
        reader.refuse(f"{where}.date_ranges", block["date_ranges"], "use start_datetime and end_datetime")
    variables = source.get("variables")
    if not isinstance(variables, dict):
        reader.refuse(f"{here}.variables", variables, "expected prognostic/diagnostic/dynamic_forcing/static groups")
        return None
    fields = []
    for kind, field in variables.items():
        if kind not in FIELD_KINDS:
            reader.refuse(f"{here}.variables.{kind}", field, f"field types are {', '.join(FIELD_KINDS)}")
            continue
        if field is None:
            continue
        fw = f"{here}.variables.{kind}"
        if not isinstance(field, dict):
            reader.refuse(fw, field, "expected vars_3D, vars_2D and path")
            continue
        names = {}
        for key in ("vars_3D", "vars_2D"):
            value = field.get(key) or []
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                reader.refuse(f"{fw}.{key}", value, "expected a list of variable names")
                value = []
            names[key] = tuple(value)
        if not names["vars_3D"] and not names["vars_2D"]:
            reader.refuse(fw, field, "define at least one of vars_3D or vars_2D (or set the group to null)")
            continue
        fields.append(FieldSettings(kind, names["vars_3D"], names["vars_2D"], field.get("path"),
                                    _time_format(reader, fw, field)))
    if not any(f.kind == "prognostic" for f in fields):
        reader.refuse(f"{here}.variables.prognostic", variables.get("prognostic"),
                      "the model predicts the prognostic variables: define some")
    levels = source.get("levels")
    if levels is not None:
        if not isinstance(levels, list) or not levels or not all(_is(v, float) for v in levels):
            reader.refuse(f"{here}.levels", levels, "expected a list of level values, matched by nearest value")
            levels = None
        else:
            levels = tuple(float(v) for v in levels)
    elif any(f.vars_3d for f in fields) and not model_levels:
        reader.refuse(f"{here}.levels", levels, "3-D variables need levels (or model.levels)")
    level_coord = source.get("level_coord")
    if any(f.vars_3d for f in fields) and not isinstance(level_coord, str):
        reader.refuse(f"{here}.level_coord", level_coord, "3-D variables need the name of the level coordinate")
    for key in ("start_datetime", "end_datetime", "timestep"):
        if not isinstance(block.get(key), (str, int, float)) or isinstance(block.get(key), bool):
            reader.refuse(f"{where}.{key}", block.get(key), "required: a date such as 2000-01-01 (timestep: 6h)")
    history = block.get("history_len", 1)
    forecast = block.get("forecast_len")
    for key, value in (("history_len", history), ("forecast_len", forecast)):
        if not _is(value, int) or value < 1:
            reader.refuse(f"{where}.{key}", value, "expected an integer >= 1 (gen2: forecast_len 1 is one step)")
    clamp = block.get("data_clamp")
    if clamp is not None:
        if not isinstance(clamp, list) or len(clamp) != 2 or not all(_is(v, float) for v in clamp):
            reader.refuse(f"{where}.data_clamp", clamp, "expected [min, max]")
            clamp = None
        else:
            clamp = (float(clamp[0]), float(clamp[1]))
    if reader.problems:
        return None
    return DataSettings(name, tuple(fields), level_coord or "level", levels, source.get("time_coord", "time"),
                        source.get("engine"), str(block["start_datetime"]), str(block["end_datetime"]),
                        str(block["timestep"]), history, forecast, clamp)


def _blocks(reader, conf):
    pre = conf.get("preblocks") or {}
    post = conf.get("postblocks") or {}
    if not isinstance(pre, dict) or not isinstance(post, dict):
        reader.refuse("preblocks" if not isinstance(pre, dict) else "postblocks", pre if not isinstance(pre, dict)
                      else post, "expected sections per_step (and ic_only / post_rollout)")
        return
    for section, blocks in pre.items():
        if section not in ("ic_only", "per_step"):
            reader.refuse(f"preblocks.{section}", blocks, "sections are ic_only and per_step")
        elif section == "ic_only" and blocks:
            reader.refuse("preblocks.ic_only", list(blocks), "no ic_only preblock (regrid, rename) is applied by tile; "
                          "prepare the data on the model's grid and names")
        elif section == "per_step":
            _block_types(reader, "preblocks.per_step", blocks, PREBLOCK_TYPES)
            if isinstance(blocks, dict):
                types = [(b or {}).get("type") for b in blocks.values()]
                if "concat" not in types:
                    reader.refuse("preblocks.per_step", list(blocks), "add the concat block (CREDIT needs it too)")
                elif types.index("concat") != len(types) - 1 and types[-1] != "to_device":
                    reader.refuse("preblocks.per_step", list(blocks), "concat must be the last block")
    for section, blocks in post.items():
        if section not in ("per_step", "post_rollout"):
            reader.refuse(f"postblocks.{section}", blocks, "sections are per_step and post_rollout")
        elif section == "post_rollout" and blocks:
            reader.refuse("postblocks.post_rollout", list(blocks), "no post_rollout block is applied by tile")
        elif section == "per_step":
            _block_types(reader, "postblocks.per_step", blocks, POSTBLOCK_TYPES)


def _block_types(reader, where, blocks, allowed):
    if not isinstance(blocks, dict):
        reader.refuse(where, blocks, "expected named blocks, e.g. concat: {type: concat}")
        return
    for name, block in blocks.items():
        kind = (block or {}).get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            reader.refuse(f"{where}.{name}.type", kind, f"mpidomain applies by tile: {', '.join(allowed)}")
            continue
        args = block.get("args") or {}
        if kind == "bridgescaler_transform":
            if args.get("spatial_variables"):
                reader.refuse(f"{where}.{name}.args.spatial_variables", args["spatial_variables"],
                              "per-gridpoint scaling is not applied by tile")
            if args.get("scaler_type", "standard") != "standard":
                reader.refuse(f"{where}.{name}.args.scaler_type", args["scaler_type"], "only standard scalers")
            if not isinstance(args.get("scaler_path"), str):
                reader.refuse(f"{where}.{name}.args.scaler_path", args.get("scaler_path"),
                              "required: the bridgescaler JSON (credit preprocess or credit convert writes it)")
        if kind == "era5_normalizer":
            for key in ("mean_path", "std_path"):
                if not isinstance(args.get(key), str):
                    reader.refuse(f"{where}.{name}.args.{key}", args.get(key), "required: the statistics file")


def _loss(reader, conf, forecast_len, ensemble_size):
    loss = conf.get("loss")
    if not isinstance(loss, dict):
        reader.refuse("loss", loss, "expected {type: base, args: {...}} or the flat training_loss form")
        return
    post = (conf.get("postblocks") or {}).get("per_step") or {}
    reconstructs = {(b.get("args") or {}).get("out_key", "y_processed"): b for b in post.values()
                    if isinstance(b, dict) and b.get("type") == "reconstruct"}
    if "type" in loss:
        if loss["type"] != "base":
            reader.refuse("loss.type", loss["type"], "mpidomain reduces type base (or the flat training_loss form)")
            return
        args = loss.get("args") or {}
        if args.get("var_weighting", "inverse_variance") not in LOSS_BASE_WEIGHTINGS:
            reader.refuse("loss.args.var_weighting", args["var_weighting"], f"one of {', '.join(LOSS_BASE_WEIGHTINGS)}")
        for key in ("training_loss", "validation_loss"):
            if "crps" in str(args.get(key, "")).lower():
                reader.refuse(f"loss.args.{key}", args[key], "CREDIT's BaseLoss scores ensembles only by ring-crps, "
                              f"which mpidomain does not train; use the flat form (loss: {{training_loss: "
                              f"{' or '.join(ENSEMBLE_LOSSES)}}}) with trainer.ensemble_size > 1")
        if "y_processed" not in reconstructs:
            reader.refuse("postblocks.per_step", list(post), "loss type base needs a reconstruct postblock")
        elif (reconstructs["y_processed"].get("args") or {}).get("detach", True):
            reader.refuse("postblocks.per_step.reconstruct.args.detach",
                          (reconstructs["y_processed"].get("args") or {}).get("detach", True),
                          "loss type base backpropagates through the reconstructed prediction: set detach: false")
        if "y_target_processed" not in reconstructs:
            reader.refuse("postblocks.per_step", list(post), "loss type base needs reconstruct_target: {type: "
                          "reconstruct, args: {in_key: y, out_key: y_target_processed}}")
        if args.get("use_latitude_weights") and not isinstance(args.get("latitude_weights"), str):
            reader.refuse("loss.args.latitude_weights", args.get("latitude_weights"),
                          "use_latitude_weights needs the path of a file with a latitude coordinate")
    else:
        name = loss.get("training_loss")
        if not isinstance(name, str):
            reader.refuse("loss.training_loss", name, "required in the flat form (e.g. mse)")
        for key in ("training_loss", "validation_loss"):
            value = loss.get(key)
            if isinstance(value, str) and "crps" in value.lower():
                if value not in ENSEMBLE_LOSSES:
                    reader.refuse(f"loss.{key}", value, f"ensemble losses trained by mpidomain: "
                                  f"{', '.join(ENSEMBLE_LOSSES)} (ring-crps puts one member on each data-parallel "
                                  "rank; mpidomain keeps the members on the batch axis)")
                elif ensemble_size < 2:
                    reader.refuse(f"loss.{key}", value, "an ensemble loss needs trainer.ensemble_size > 1 "
                                  f"(CREDIT refuses it too); got {ensemble_size}")
        weighted = loss.get("use_latitude_weights") or loss.get("use_variable_weights")
        for key in ("use_spectral_loss", "use_power_loss"):
            if not loss.get(key):
                continue
            if not weighted:
                reader.refuse(f"loss.{key}", loss[key], "CREDIT adds the spectral and power terms only inside "
                              "VariableTotalLoss2D and ignores them otherwise: set use_latitude_weights or "
                              "use_variable_weights, or set it false")
            for needed, kind in (("spectral_lambda_reg", float), ("spectral_wavenum_init", int)):
                if not _is(loss.get(needed), kind):
                    reader.refuse(f"loss.{needed}", loss.get(needed), f"required with {key} (CREDIT reads it): "
                                  f"{'the weight of the term' if kind is float else 'the first wavenumber scored'}")
        if loss.get("use_latitude_weights") and not isinstance(loss.get("latitude_weights"), str):
            reader.refuse("loss.latitude_weights", loss.get("latitude_weights"), "required with use_latitude_weights")
    if forecast_len > 1 and "y_processed" not in reconstructs:
        reader.refuse("postblocks.per_step", list(post), "forecast_len > 1 feeds the prediction back: add "
                      "reconstruct: {type: reconstruct} as the first postblock")


def _metrics(reader, conf):
    metrics = conf.get("metrics")
    if not metrics:
        return
    if not isinstance(metrics, dict) or metrics.get("type") != "combined":
        reader.refuse("metrics.type", metrics.get("type") if isinstance(metrics, dict) else metrics,
                      "mpidomain computes type combined")
        return
    args = metrics.get("args") or {}
    for name in args.get("metrics") or {}:
        if name not in METRIC_TYPES:
            reader.refuse(f"metrics.args.metrics.{name}", (args["metrics"] or {}).get(name),
                          f"metrics computed from tiles: {', '.join(METRIC_TYPES)}")


def _trainer(reader, trainer, world_size, domain_override):
    get = lambda key, default, kind: reader.get(trainer, key, default, kind, "trainer")  # noqa: E731
    if trainer.get("type") not in TRAINER_TYPES:
        reader.refuse("trainer.type", trainer.get("type"), f"mpidomain trains {' / '.join(TRAINER_TYPES)}")
    parallelism = trainer.get("parallelism")
    if not isinstance(parallelism, dict):
        reader.refuse("trainer.parallelism", parallelism, "required by gen2: {data: none|ddp|fsdp2, tensor: 1, "
                      "domain: D} (credit convert writes it from trainer.mode)")
        parallelism = {}
    data_mode = parallelism.get("data", "none")
    if data_mode not in ("none", "ddp", "fsdp2"):
        reader.refuse("trainer.parallelism.data", data_mode, "expected none, ddp or fsdp2")
    if parallelism.get("tensor", 1) != 1:
        reader.refuse("trainer.parallelism.tensor", parallelism.get("tensor"), "tensor parallelism is not trained "
                      "by mpidomain credit train; use tensor: 1 and more domain ranks")
    domain = domain_override
    if domain is None:
        try:
            domain = parse_domain(parallelism.get("domain", 1))
        except UsageError as error:
            reader.problems.append(str(error))
            domain = (1,)
    size = 1
    for d in domain:
        size *= d
    if world_size % size:
        where = "-D" if domain_override is not None else "trainer.parallelism.domain"
        reader.refuse(where, "x".join(map(str, domain)), f"{world_size} ranks do not split into domain groups of "
                      f"{size}; launch a multiple of {size} ranks")
    elif world_size // size > 1 and data_mode == "none":
        reader.refuse("trainer.parallelism.data", data_mode, f"{world_size // size} data-parallel groups would train "
                      f"{world_size // size} different models (CREDIT warns and lets them drift); set data: ddp")
    for key in ("learning_rate", "weight_decay", "train_batch_size"):
        if key not in trainer:
            reader.refuse(f"trainer.{key}", None, "required (CREDIT reads it too)")
    if "amp" not in trainer:
        reader.refuse("trainer.amp", None, "required (CREDIT reads it too): true or false")
    max_norm = trainer.get("grad_max_norm", 0.0)
    if not (max_norm == "dynamic" or _is(max_norm, float)):
        reader.refuse("trainer.grad_max_norm", max_norm, "expected a number (0: no clipping) or dynamic")
    scheduler = trainer.get("scheduler") or {}
    use_scheduler = get("use_scheduler", True, bool)
    if use_scheduler and not isinstance(scheduler.get("scheduler_type"), str):
        reader.refuse("trainer.scheduler.scheduler_type", scheduler.get("scheduler_type"),
                      "use_scheduler needs a scheduler (e.g. linear-warmup-cosine), or set use_scheduler: false")
    return domain, data_mode, max_norm, use_scheduler, scheduler.get("scheduler_type", "")


def _ensemble_size(reader, trainer, forecast_len, valid_forecast_len):
    """``trainer.ensemble_size``, checked: an integer >= 1; more than 1 only with forecast_len 1."""
    size = trainer.get("ensemble_size", 1)
    if not _is(size, int) or size < 1:
        reader.refuse("trainer.ensemble_size", size, "expected an integer >= 1 (members per sample)")
        return 1
    if size > 1:
        for where, steps in (("data.forecast_len", forecast_len), ("validation_data.forecast_len", valid_forecast_len)):
            if steps > 1:
                reader.refuse(where, steps, f"trainer.ensemble_size {size} trains one step: CREDIT 2026.2.0 feeds "
                              f"the {size} members' prediction back beside one sample's forcing, which it cannot "
                              "join; use forecast_len: 1")
    return size


def read_data(block, where="data", model_levels=None):
    """Return the :class:`DataSettings` of a ``data``-shaped ``block`` (the config key ``where``).

    Pure. Raises :class:`UsageError` with one line listing every refused key, alike on every rank.
    ``model_levels`` is ``model.levels`` (3-D variables need levels from one of them).
    """
    reader = _Reader({})
    data = _data(reader, block, where, model_levels)
    if reader.problems:
        raise UsageError("; ".join(reader.problems))
    return data


def check_blocks(conf):
    """Check the ``preblocks`` and ``postblocks`` of ``conf``: the block types applied by tile, and their keys.

    Pure. Raises :class:`UsageError` with one line listing every refused block, alike on every rank.
    """
    reader = _Reader(conf)
    _blocks(reader, conf)
    if reader.problems:
        raise UsageError("; ".join(reader.problems))


def read_settings(conf, world_size, domain=None):
    """Return the :class:`TrainSettings` of ``conf`` for ``world_size`` ranks; ``domain`` (from ``-D``) overrides
    ``trainer.parallelism.domain``.

    Pure. Raises :class:`UsageError` with one line listing every refused key (``key = value: why``), alike on
    every rank (every rank reads the same config).
    """
    reader = _Reader(conf)
    if not isinstance(conf.get("save_loc"), str):
        reader.refuse("save_loc", conf.get("save_loc"), "required: the run's folder")
    if conf.get("custom_objects"):
        reader.refuse("custom_objects", conf["custom_objects"], "custom classes are not converted by tile")
    trainer = conf.get("trainer")
    if not isinstance(trainer, dict):
        raise UsageError(f"trainer = {trainer!r}: required: {{type: gen2, parallelism: ..., ...}}")
    model = conf.get("model")
    if not isinstance(model, dict) or "type" not in model:
        reader.refuse("model.type", (model or {}).get("type") if isinstance(model, dict) else model,
                      "required: the model CREDIT's loader builds (e.g. wxformer)")
        model = {}
    data = _data(reader, conf.get("data"), "data", model.get("levels"))
    valid_block = conf.get("validation_data") or conf.get("data")
    if isinstance(valid_block, dict) and "source" not in valid_block and isinstance(conf.get("data"), dict):
        valid_block = dict(valid_block, source=conf["data"].get("source"))
    if isinstance(valid_block, dict) and isinstance(conf.get("data"), dict):
        missing = sorted(set(conf["data"]) - set(valid_block))
        if missing:
            reader.refuse("validation_data", sorted(valid_block), f"missing keys {missing} that data has (CREDIT "
                          "refuses a partial block too); add them or remove validation_data")
    valid = _data(reader, valid_block, "validation_data", model.get("levels")) if not reader.problems else None
    _blocks(reader, conf)
    forecast_len = data.forecast_len if data else 1
    ensemble_size = _ensemble_size(reader, trainer, forecast_len, valid.forecast_len if valid else forecast_len)
    _loss(reader, conf, forecast_len, ensemble_size)
    _metrics(reader, conf)
    domain, data_mode, max_norm, use_scheduler, scheduler_type = _trainer(reader, trainer, world_size, domain)
    bpt = trainer.get("backprop_on_timestep") or (conf.get("data") or {}).get("backprop_on_timestep")
    if bpt is not None and (not isinstance(bpt, list) or not all(_is(t, int) and 1 <= t <= forecast_len for t in bpt)):
        reader.refuse("trainer.backprop_on_timestep", bpt, f"expected steps between 1 and forecast_len {forecast_len}")
        bpt = None
    g = lambda key, default, kind=None: reader.get(trainer, key, default, kind, "trainer")  # noqa: E731
    values = dict(
        batch=g("train_batch_size", 1, int), valid_batch=g("valid_batch_size", g("train_batch_size", 1, int), int),
        batches_per_epoch=g("batches_per_epoch", 0, int), valid_batches_per_epoch=g("valid_batches_per_epoch", 0, int),
        start_epoch=g("start_epoch", 0, int), epochs=g("epochs", 1, int), num_epoch=g("num_epoch", int(1e8), int),
        grad_accum_every=g("grad_accum_every", 1, int), amp=g("amp", True, bool),
        activation_checkpoint=g("activation_checkpoint", False, bool), compile=g("compile", False, bool),
        use_ema=g("use_ema", False, bool), ema_decay=float(g("ema_decay", 0.9999, float)),
        thread_workers=g("thread_workers", 4, int), valid_thread_workers=g("valid_thread_workers", 4, int),
        prefetch_factor=g("prefetch_factor", 2, int), skip_validation=g("skip_validation", False, bool),
        skip_nan_prune=g("skip_nan_prune", False, bool), load_weights=g("load_weights", False, bool),
        load_optimizer=g("load_optimizer", False, bool), load_scaler=g("load_scaler", False, bool),
        load_scheduler=g("load_scheduler", False, bool), reload_epoch=g("reload_epoch", False, bool),
        update_learning_rate=g("update_learning_rate", False, bool),
        save_backup_weights=g("save_backup_weights", True, bool), save_best_weights=g("save_best_weights", True, bool),
        save_every_epoch=g("save_every_epoch", False, bool), stopping_patience=g("stopping_patience", 100, int),
        stop_after_epoch=g("stop_after_epoch", False, bool), train_one_epoch=g("train_one_epoch", False, bool),
        use_tensorboard=g("use_tensorboard", False, bool), ensemble_size=ensemble_size,
    )
    skip = values["skip_validation"]
    metric = g("training_metric", "train_loss" if skip else "valid_loss", str)
    direction = g("training_metric_direction", "min", str)
    if direction not in ("min", "max"):
        reader.refuse("trainer.training_metric_direction", direction, "expected min or max")
    for key in ("batch", "valid_batch", "grad_accum_every", "epochs"):
        if values[key] < 1:
            reader.refuse(f"trainer.{key}", values[key], "expected an integer >= 1")
    for key in ("learning_rate", "weight_decay"):
        value = trainer.get(key)
        try:
            float(value)
        except (TypeError, ValueError):
            reader.refuse(f"trainer.{key}", value, "expected a number")
    if reader.problems:
        raise UsageError("; ".join(reader.problems))
    # The validation source is read under the training source's name: the variable keys (and so the channel
    # layout, the scalers and the loss's variables) are the training run's.
    valid = replace(valid, source=data.source)
    seed = conf.get("seed", 42)
    return TrainSettings(
        conf=conf, data=data, valid=valid, save_loc=os.path.expandvars(conf["save_loc"]), seed=int(seed),
        domain=tuple(domain), data_mode=data_mode, grad_max_norm=max_norm if max_norm == "dynamic" else float(max_norm),
        backprop_on_timestep=tuple(bpt) if bpt else tuple(range(1, forecast_len + 1)),
        use_scheduler=use_scheduler, scheduler_type=scheduler_type, training_metric=metric, direction=direction,
        save_metric_vars=trainer.get("save_metric_vars", True), learning_rate=float(trainer["learning_rate"]),
        weight_decay=float(trainer["weight_decay"]), **values)

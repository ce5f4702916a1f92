"""CREDIT's per-step preblocks and postblocks on tiles: :class:`Blocks`.

The chain ``credit train`` runs around the model, element by element, so a tile gives its part of
the whole field's result exactly:

- preblocks ``per_step``: ``era5_normalizer`` (mean/std files) and ``bridgescaler_transform``
  (bridgescaler JSON) scale each listed variable, ``(x - mean_l) / sqrt(var_l)`` with
  ``var_l = std_l**2`` in float32 (bridgescaler's ``DStandardScalerTensor``, called on the tile);
  ``concat`` stacks the inputs in CREDIT's channel order (prognostic, static, dynamic forcing; 3-D
  before 2-D; config order) and the targets in theirs (prognostic then diagnostic);
- postblocks ``per_step``: ``reconstruct`` splits the flat prediction (or target, ``in_key: y``)
  into ``{key: (B, levels, 1, rows, columns)}``; ``bridgescaler_transform`` inverts the scaling.

``era5_normalizer`` has no inverse postblock in CREDIT 2026.2.0, so the fed-back prediction is
normalised twice there from rollout step 2; here its inverse follows each ``reconstruct`` (of the
prediction and of the target twin), which is what CREDIT intends and what CREDIT's own converter
(``credit convert``: the same statistics as bridgescaler scalers) gives. Local: no MPI.
"""

import warnings

import numpy as np
import torch

from ..command import UsageError

__all__ = ["Blocks", "era5_scalers", "channel_layouts"]


def _apply(scaler, method, tensor):
    """bridgescaler's ``method`` on ``tensor`` (its warning about unnamed channels, as CREDIT's calls, silenced)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input data lacks variable names")
        return getattr(scaler, method)(tensor)


def _selected(variables, keys):
    """CREDIT's variable selection: an empty list is every key; an entry selects itself and the keys under it."""
    if not variables:
        return list(keys)
    chosen = []
    for entry in variables:
        for key in keys:
            if (key == entry or key.startswith(entry.rstrip("/") + "/")) and key not in chosen:
                chosen.append(key)
    return chosen


def era5_scalers(mean_path, std_path, keys, levels=None):
    """Return ``{key: DStandardScalerTensor}`` for the ``keys`` whose variable is in both statistics files.

    As CREDIT's converter builds them: float32 means, ``var = std**2`` computed in float32; ``levels``
    (``era5_normalizer``'s 1-indexed model levels) picks entries of per-level statistics first. Local.
    """
    import torch as _torch
    import xarray as xr
    from bridgescaler.distributed_tensor import DStandardScalerTensor

    scalers = {}
    with xr.open_dataset(mean_path) as mean, xr.open_dataset(std_path) as std:
        names = set(mean.data_vars) & set(std.data_vars)
        for key in keys:
            name = key.split("/")[-1]
            if name not in names:
                continue
            m = np.atleast_1d(np.array(mean[name].values, dtype=np.float32))
            s = np.atleast_1d(np.array(std[name].values, dtype=np.float32))
            if levels is not None and m.size > 1:
                m, s = m[[lv - 1 for lv in levels]], s[[lv - 1 for lv in levels]]
            scaler = DStandardScalerTensor(channels_last=False)
            scaler.mean_x_, scaler.var_x_ = _torch.tensor(m), _torch.tensor(s ** 2)
            scaler.x_columns_, scaler._fit, scaler.n_ = list(range(len(m))), True, 1
            scalers[key] = scaler
    return scalers


def channel_layouts(conf, saved=False):
    """Return (input layout, target layout): lists of ``(key, levels, times)`` in CREDIT's channel order.

    CREDIT's ``ChannelSchema.from_config`` of the config (the layout its ``concat`` validates against); with
    ``saved``, as ``credit rollout`` finds it: ``save_loc/channel_schema.yaml`` (the training run's) where it
    exists (``ChannelSchema.load_or_from_config``). Local.
    """
    from credit.datasets.gen_2.channel_utils import ChannelSchema

    schema = ChannelSchema.load_or_from_config(conf) if saved else ChannelSchema.from_config(conf)
    if schema is None:
        raise UsageError("data: no channel layout: neither save_loc/channel_schema.yaml nor the data block gives "
                         "the model's channels")
    as_list = lambda layout: [(e["var_key"], int(e["n_levels"]), int(e["n_time"])) for e in layout]  # noqa: E731
    return as_list(schema.input_layout), as_list(schema.target_layout)


class Blocks:
    """The per-step chain of a config, applied to tiles.

    Build once (reads the scaler files; local). :meth:`pre` normalises the named input and target tensors and
    concatenates them; :meth:`post` reconstructs and un-normalises the flat prediction and target.
    ``layouts`` (input, target) replaces the config's own channel layout (:func:`channel_layouts`).
    """

    def __init__(self, conf, settings, layouts=None):
        self.input_layout, self.target_layout = layouts if layouts is not None else channel_layouts(conf)
        self.levels = {key: levels for key, levels, _ in self.input_layout + self.target_layout}
        input_keys = [key for key, _, _ in self.input_layout]
        target_keys = [key for key, _, _ in self.target_layout]
        self.pre_steps, self.post_steps = [], []
        era5 = None
        for name, block in ((conf.get("preblocks") or {}).get("per_step") or {}).items():
            kind, args = block["type"], block.get("args") or {}
            if kind == "era5_normalizer":
                try:
                    scalers = era5_scalers(args["mean_path"], args["std_path"], input_keys + target_keys,
                                           args.get("levels"))
                except (OSError, ValueError) as error:
                    raise UsageError(f"preblocks.per_step.{name}.args: cannot read the statistics {args['mean_path']} "
                                     f"and {args['std_path']} ({type(error).__name__}: {error})") from None
                era5 = scalers
                self.pre_steps.append((("input", "target"), scalers, "transform"))
            elif kind == "bridgescaler_transform":
                scalers = _load_scalers(args["scaler_path"], f"preblocks.per_step.{name}")
                types = tuple(args.get("data_types") or ("input", "target"))
                method = args.get("method", "transform")
                for data_type in types:
                    keys = input_keys if data_type == "input" else target_keys
                    chosen = _selected(args.get("variables") or [], keys)
                    table = {k: s for k, s in (scalers.get(data_type) or {}).get(settings.data.source, {}).items()
                             if k in chosen}
                    missing = [k for k in chosen if k not in table]
                    if missing:
                        raise UsageError(
                            f"preblocks.per_step.{name}.args.scaler_path = {args['scaler_path']!r}: no {data_type} "
                            f"scaler for {', '.join(missing)}; list only scaled variables in args.variables")
                    _check_channels(table, self.levels, args["scaler_path"], f"preblocks.per_step.{name}")
                    self.pre_steps.append(((data_type,), table, method))
        for name, block in ((conf.get("postblocks") or {}).get("per_step") or {}).items():
            kind, args = block["type"], block.get("args") or {}
            if kind == "reconstruct":
                out_key = args.get("out_key", "y_processed")
                self.post_steps.append(("reconstruct", args.get("in_key", "y_pred"), out_key,
                                        bool(args.get("detach", True))))
                if era5 is not None:  # the inverse CREDIT 2026.2.0 lacks (see the module docstring)
                    self.post_steps.append(("scale", out_key, {k: era5[k] for k in target_keys if k in era5},
                                            "inverse_transform"))
            elif kind == "bridgescaler_transform":
                scalers = _load_scalers(args["scaler_path"], f"postblocks.per_step.{name}")
                target = (scalers.get("target") or {}).get(settings.data.source, {})
                chosen = _selected(args.get("variables") or [], target_keys)
                table = {k: target[k] for k in chosen if k in target}
                _check_channels(table, self.levels, args["scaler_path"], f"postblocks.per_step.{name}")
                self.post_steps.append(("scale", args.get("key", "y_processed"), table,
                                        args.get("method", "inverse_transform")))
        self.clamp = settings.data.clamp

    def pre(self, inputs, targets=None):
        """Return ``(x, y)``: the normalised, concatenated input ``(B, C_in, T, rows, columns)`` and target
        ``(B, C_out, rows, columns)`` (None without ``targets``), float32, from named tensors of CREDIT's keys."""
        named = {"input": dict(inputs), "target": dict(targets) if targets is not None else None}
        for data_types, scalers, method in self.pre_steps:
            for data_type in data_types:
                tensors = named[data_type]
                if tensors is None:
                    continue
                for key, scaler in scalers.items():
                    if key in tensors:
                        tensors[key] = _apply(scaler, method, tensors[key])
        x = torch.cat([named["input"][key] for key, _, _ in self.input_layout], dim=1).float()
        y = None
        if targets is not None:
            y = torch.cat([named["target"][key] for key, _, _ in self.target_layout], dim=1).float().flatten(1, 2)
        if self.clamp is not None:
            x = torch.clamp(x, min=self.clamp[0], max=self.clamp[1])
        return x, y

    def split(self, flat):
        """``(B, C_out, rows, columns)`` as ``{key: (B, levels, 1, rows, columns)}`` in the target layout."""
        out, at = {}, 0
        for key, levels, _ in self.target_layout:
            out[key] = flat[:, at:at + levels].unflatten(1, (levels, 1))
            at += levels
        return out

    def post(self, state):
        """Run the postblocks on ``state`` (a dict with ``y_pred`` and, in training, ``y``); return it."""
        for step in self.post_steps:
            if step[0] == "reconstruct":
                _, in_key, out_key, detach = step
                if state.get(in_key) is None:  # the target's twin in a forecast, which has no target
                    continue
                flat = state[in_key]
                if self.clamp is not None and in_key == "y":
                    flat = torch.clamp(flat.float(), min=self.clamp[0], max=self.clamp[1])
                split = self.split(flat)
                state[out_key] = {k: v.detach() for k, v in split.items()} if detach else split
            else:
                _, key, scalers, method = step
                if key in state:
                    tensors = dict(state[key])
                    for name, scaler in scalers.items():
                        if name in tensors:
                            tensors[name] = _apply(scaler, method, tensors[name])
                    state[key] = tensors
        return state

    def physical(self, flat):
        """The prediction ``(B, C_out, rows, columns)`` as named tensors in physical units (the ``y_processed``
        chain, no gradient): for output writers."""
        return self.post({"y_pred": flat.detach()}).get("y_processed", {})


def _check_channels(table, levels, path, where):
    """Refuse a scaler whose channels are not the variable's levels (bridgescaler would assert mid-step)."""
    for key, scaler in table.items():
        columns = getattr(scaler, "x_columns_", None)
        if columns is not None and key in levels and len(columns) != levels[key]:
            raise UsageError(f"{where}.args.scaler_path = {path!r}: the scaler of {key} holds {len(columns)} "
                             f"channel(s), the data has {levels[key]} level(s) of it; write the scalers for this "
                             "config's levels (credit convert) or give the file written for them")


def _load_scalers(path, where):
    from bridgescaler import load_scaler_dict

    try:
        return load_scaler_dict(path)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"{where}.args.scaler_path = {path!r}: cannot read the bridgescaler JSON "
                         f"({type(error).__name__}: {error})") from None

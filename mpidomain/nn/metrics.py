"""Latitude-weighted losses and metrics of the whole field, computed from each rank's shard, slab or tile.

Each rank holds some rows (latitudes) and columns (longitudes) of the grid;
its sums over them are all-reduced over its domain group in float64, so every
rank gets the single-process value, and the loss's gradient with respect to a
rank's ``pred`` is exactly its part of the single-process gradient.

Conventions are CREDIT's (``credit.losses.gen_1.weighted_loss`` and
``LatWeightedMetrics`` in ``credit.metrics``): row weights are ``cos(latitude)``
over their mean across the global grid's rows; the loss is the mean of
``weight * (pred - target)**2`` over every element; RMSE and ACC are per channel.
"""

import numpy as np
import torch

from .._agreement import agree
from .._current import require_manager
from ..manager import library_comm, sharded_dims
from ..reduce import reduce_array
from . import ops, plans

__all__ = ["latitude_weights", "LatitudeWeightedMSE", "latitude_weighted_rmse", "latitude_weighted_acc",
           "ACC_EPSILON"]

ACC_EPSILON = 1e-7  # what CREDIT's LatWeightedMetrics adds to the ACC denominator


def latitude_weights(latitude, manager=None):
    """Return this rank's rows of ``cos(latitude)`` divided by its mean over the global grid's rows, in float64.

    Collective over the domain group: call on all its ranks, each with its own
    rows' latitudes in degrees (a 1-D array, list or tensor: what
    ``select_tile(ds)["latitude"].values`` or the rows of ``shard_tensor``
    give). Every global row counts once in the mean: with tiles, the ranks of
    a tile row (and with longitude slabs, all ranks) must pass the same
    latitudes, and are checked to. Each rank gets its rows' weights, of the
    input's kind (a float64 NumPy array, or a float64 tensor on the input's
    device). With no manager in a one-process job, the rows are the whole grid.
    A mistake on any rank raises the same ValueError or TypeError on every rank.
    """
    weights, _ = _gathered_weights("latitude_weights", latitude, manager)
    if isinstance(latitude, torch.Tensor):
        return torch.from_numpy(weights).to(latitude.device)
    return weights


class LatitudeWeightedMSE(torch.nn.Module):
    """The latitude-weighted MSE of the whole field: ``mean(weight * (pred - target)**2)`` over every element.

    Construction is collective over the domain group, as
    :func:`latitude_weights` (``latitude``: this rank's rows, in degrees).
    Calling ``loss(pred, target)`` is collective over the domain group too:
    every rank passes its part of (B, C, H, W) or (B, C, T, H, W) fields
    (latitude and longitude last, as the manager shards them; other dims the
    same on every rank) and gets the float64 loss of the whole field, the same
    on every rank. Its gradient with respect to this rank's ``pred`` is this
    rank's part of the single-process gradient, so after ``backward`` (on every
    rank) ``allreduce_gradients(model, group="domain", op="sum")`` gives the
    single-process parameter gradients. With data-parallel groups the loss is
    over this domain group's samples (averaging across groups is the gradient
    all-reduce's job). Each element's weight is its row's; the sums are float64.
    """

    def __init__(self, latitude, manager=None):
        super().__init__()
        weights, self._manager = _gathered_weights("LatitudeWeightedMSE", latitude, manager)
        # A plain attribute, not a buffer: module.float() or .half() must not round the weights.
        self.weights = torch.from_numpy(weights)

    def forward(self, pred, target):
        """Return the float64 loss of the whole field; collective over the domain group (see the class)."""
        error = _fields_error("LatitudeWeightedMSE", pred, target, least_dims=2)
        if error is None and pred.shape[-2] != len(self.weights):
            error = ValueError(
                f"LatitudeWeightedMSE: pred has {pred.shape[-2]} rows (dim -2) on this rank but the loss was built "
                f"with {len(self.weights)} latitudes; build it with this rank's rows' latitudes (those of its shard)")
        if self._manager is None:
            if error is not None:
                raise error
        elif error is not None:
            ops.raise_on_every_rank(library_comm(self._manager, "domain"), "LatitudeWeightedMSE", error)
        else:
            plans.planned(self._manager, "LatitudeWeightedMSE", _description(pred, target))
        self.weights = self.weights.to(pred.device)
        squared = (pred.double() - target.double()).square()
        partial = (_sum_but_rows(squared) * self.weights).sum()
        totals = torch.stack([partial, partial.new_tensor(float(squared.numel()))])
        if self._manager is not None:
            totals = ops.sum_partials(totals, self._manager)
        return totals[0] / totals[1]


def latitude_weighted_rmse(pred, target, latitude, manager=None):
    """Return the per-channel latitude-weighted RMSE of the whole field: a float64 tensor of shape (C,).

    Collective over the domain group: every rank passes its part of
    (B, C, H, W) or (B, C, T, H, W) fields (other dims the same on every rank)
    and its rows' latitudes in degrees, and gets the same values, those of one
    process on the whole field. CREDIT's convention: for each channel, the
    square root of the weighted spatial mean ``mean_HW(weight * (pred - target)**2)``
    of each sample (and time step), then averaged over samples (and time steps):
    the batch mean comes after the square root. No gradient (inputs are detached).
    """
    call = "latitude_weighted_rmse"
    pred, target = _detached(pred), _detached(target)
    error = _fields_error(call, pred, target, least_dims=4)
    weights, manager = _gathered_weights(call, latitude, manager, error, *_rows_and_description(pred, target, error))
    weights = torch.from_numpy(weights).to(pred.device)
    squared = (pred.double() - target.double()).square()
    spatial = (squared.sum(dim=-1) * weights).sum(dim=-1)  # (B, C, ...): this rank's weighted sums
    totals = torch.cat([spatial.flatten(), spatial.new_tensor([float(squared.shape[-2] * squared.shape[-1])])])
    totals = _sum_over_domain(totals, manager)
    rmse = (totals[:-1] / totals[-1]).sqrt().view(spatial.shape)
    return _per_channel(rmse).mean(dim=1)


def latitude_weighted_acc(pred, target, climatology, latitude, manager=None):
    """Return the per-channel latitude-weighted anomaly correlation of the whole field: float64, shape (C,).

    Collective over the domain group: every rank passes its part of
    (B, C, H, W) or (B, C, T, H, W) fields, a ``climatology`` that broadcasts to
    its part (e.g. this rank's (C, H, W) rows and columns, or (C, 1, 1)) and
    its rows' latitudes in degrees, and gets the same values, those of one
    process on the whole field. CREDIT's convention (``LatWeightedMetrics`` with
    a climatology): anomalies ``a = x - climatology``; the plain (unweighted)
    mean anomaly of each channel, over samples, time steps and the grid, is
    removed; ``ACC = sum(w a_p a_t) / (sqrt(sum(w a_p**2) * sum(w a_t**2)) + ACC_EPSILON)``,
    the sums over samples too (one correlation per channel, not a batch mean).
    No gradient (inputs are detached).
    """
    call = "latitude_weighted_acc"
    pred, target = _detached(pred), _detached(target)
    error = _fields_error(call, pred, target, least_dims=4)
    if error is None:
        error = _climatology_error(call, climatology, pred)
    weights, manager = _gathered_weights(call, latitude, manager, error, *_rows_and_description(pred, target, error))
    weights = torch.from_numpy(weights).to(pred.device)
    climatology = torch.as_tensor(_detached(climatology), device=pred.device).double()
    forecast, truth = pred.double() - climatology, target.double() - climatology
    channels, shape = pred.shape[1], [1] * pred.ndim
    shape[1] = channels
    count = forecast.numel() / channels
    sums = torch.cat([_per_channel(forecast).sum(dim=1), _per_channel(truth).sum(dim=1),
                      forecast.new_tensor([count])])
    sums = _sum_over_domain(sums, manager)
    forecast = forecast - (sums[:channels] / sums[-1]).view(shape)
    truth = truth - (sums[channels:-1] / sums[-1]).view(shape)
    moments = torch.cat([_weighted_channel_sums(a * b, weights)
                         for a, b in ((forecast, truth), (forecast, forecast), (truth, truth))])
    covariance, forecast_power, truth_power = _sum_over_domain(moments, manager).view(3, channels)
    return covariance / ((forecast_power * truth_power).sqrt() + ACC_EPSILON)


def _agreed_fields(manager, description):
    """The loss's agreement step on ``description`` (:func:`_description`); collective over the domain group."""
    agree(library_comm(manager, "domain"), "LatitudeWeightedMSE", description,
          mismatch=lambda descriptions: _mismatch("LatitudeWeightedMSE", descriptions))
    return True


plans.register_gather("LatitudeWeightedMSE", _agreed_fields)


def _sum_over_domain(values, manager):
    """``values`` summed over the domain group (no autograd); themselves with no manager."""
    return values if manager is None else reduce_array(values, "sum", library_comm(manager, "domain"))


def _gathered_weights(call, latitude, manager, error=None, rows=None, description=None):
    """Return (this rank's float64 NumPy weights, the manager or None); collective over the domain group.

    One agreement step (a local ``error`` raises on every rank) and one allgather of every rank's latitudes
    and ``description`` (of its other arguments, which must match); then every rank takes the same decisions
    from the same gathered records, so a mistake raises alike everywhere. ``rows``: the number of latitudes
    expected, if known.
    """
    latitudes = None
    if error is None:
        latitudes, error = _latitudes(call, latitude, rows)
    manager = require_manager(manager, call, alone_ok=True)
    if manager is None:
        if error is not None:
            raise error
        return _weights(latitudes, [latitudes], call), None
    block = _row_block(call, manager)
    comm = library_comm(manager, "domain")
    agree(comm, call, None, error=error)
    records = comm.allgather((block, latitudes, description))
    descriptions = [record[2] for record in records]
    if any(d != descriptions[0] for d in descriptions):
        raise _mismatch(call, descriptions)
    blocks = {}  # block -> (first rank, its latitudes): each global row once, in rank order
    for rank, (index, rows_of_rank, _) in enumerate(records):
        first = blocks.setdefault(index, (rank, rows_of_rank))
        if not np.array_equal(first[1], rows_of_rank):
            raise ValueError(
                f"{call}: ranks {first[0]} and {rank} hold the same latitude rows ({_block_name(manager)} {index}) "
                f"but passed different latitudes ({len(first[1])} and {len(rows_of_rank)} values); pass each rank "
                "the latitudes of its own rows")
    return _weights(latitudes, [rows_of_block for _, rows_of_block in blocks.values()], call), manager


def _latitudes(call, latitude, rows):
    """Return (``latitude`` as a 1-D float64 NumPy array, None), or (None, the error)."""
    try:
        if isinstance(latitude, torch.Tensor):
            latitude = latitude.detach().cpu().numpy()
        values = np.asarray(latitude, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        return None, TypeError(f"{call}: latitude must be a 1-D array of degrees (NumPy, list or tensor), got "
                               f"{type(latitude).__name__} ({exc})")
    if values.ndim != 1:
        return None, ValueError(f"{call}: latitude must be 1-D (this rank's rows' latitudes in degrees), got shape "
                                f"{values.shape}; pass e.g. select_tile(ds)['latitude'].values")
    if not np.isfinite(values).all():
        return None, ValueError(f"{call}: latitude holds non-finite values; pass latitudes in degrees")
    if rows is not None and len(values) != rows:
        return None, ValueError(f"{call}: latitude has {len(values)} values on this rank but the fields have {rows} "
                                "rows (dim -2); pass this rank's rows' latitudes (those of its shard or tile)")
    return values, None


def _weights(latitudes, global_rows, call):
    """cos(latitudes) over the mean of cos over ``global_rows`` (the blocks of the global grid, in order)."""
    everything = np.concatenate(global_rows)
    mean = np.cos(np.deg2rad(everything)).mean() if len(everything) else 0.0
    if not mean > 0:
        raise ValueError(f"{call}: the mean of cos(latitude) over the grid's {len(everything)} rows is {mean}, not "
                         "positive; pass latitudes in degrees within (-90, 90)")
    return np.cos(np.deg2rad(latitudes)) / mean


def _row_block(call, manager):
    """Which latitude rows this rank holds: ranks of the same block hold the same rows; blocks go in rank order."""
    if manager.shard_dims in ((-2,), (-1,), (-2, -1)):
        # Latitude is dim 0 of (lat, lon): the tile row, a latitude slab's rank, or 0 (longitude slabs: every row).
        return next((s.coord for s in sharded_dims(manager, 2) if s.dim == 0), 0)
    raise ValueError(f"{call} needs latitude in dim -2 and longitude in dim -1: a manager with shard_dim=-2, -1 or "
                     f"(-2, -1), got shard_dim={manager.shard_dim}")


def _block_name(manager):
    return "tile row" if manager.tiled else "block"


def _fields_error(call, pred, target, least_dims):
    """Return the TypeError/ValueError for ``pred`` and ``target`` of this rank, or None."""
    for name, value in (("pred", pred), ("target", target)):
        if not isinstance(value, torch.Tensor):
            return TypeError(f"{call}: {name} must be a torch tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            return TypeError(f"{call}: {name} must be a floating-point tensor, got {value.dtype}")
    if pred.shape != target.shape:
        return ValueError(f"{call}: pred and target must have the same shape on each rank, got {tuple(pred.shape)} "
                          f"and {tuple(target.shape)}")
    if pred.ndim < least_dims:
        layout = "(B, C, H, W) or (B, C, T, H, W)" if least_dims == 4 else "(..., H, W)"
        return ValueError(f"{call}: fields must be {layout}, latitude and longitude last, got shape "
                          f"{tuple(pred.shape)}")
    return None


def _climatology_error(call, climatology, pred):
    """Return the TypeError/ValueError for a ``climatology`` that does not broadcast to ``pred``, or None."""
    try:
        shape = torch.as_tensor(_detached(climatology)).shape
    except (TypeError, RuntimeError, ValueError) as exc:
        return TypeError(f"{call}: climatology must be a tensor or array, got {type(climatology).__name__} ({exc})")
    try:
        broadcast = torch.broadcast_shapes(shape, pred.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != pred.shape:
        return ValueError(f"{call}: climatology of shape {tuple(shape)} does not broadcast to pred's "
                          f"{tuple(pred.shape)}; pass this rank's rows and columns of it, e.g. (C, H, W) or (C, 1, 1)")
    return None


def _description(pred, target):
    """What must match on every rank of the domain group: dims but the last two, and dtypes."""
    return (tuple(pred.shape[:-2]), str(pred.dtype), str(target.dtype))


def _mismatch(call, descriptions):
    """The ValueError for ranks whose :func:`_description` differ."""
    listing = ", ".join(f"rank {r}: ({', '.join(map(str, dims))}, H, W) {pred} and {target}"
                        for r, (dims, pred, target) in enumerate(descriptions))
    return ValueError(f"{call} needs the same dims (all but the last two, latitude and longitude) and dtypes on every "
                      f"rank of the domain group, got pred and target {listing}; pass each rank its part of the same "
                      "fields")


def _rows_and_description(pred, target, error):
    """(the rows ``latitude`` must have, :func:`_description`) of valid fields; (None, None) after an ``error``."""
    return (None, None) if error is not None else (pred.shape[-2], _description(pred, target))


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else value


def _sum_but_rows(x):
    """Sum ``x`` over every dim but -2 (the rows)."""
    return x.sum(dim=tuple(d for d in range(x.ndim) if d != x.ndim - 2))


def _per_channel(x):
    """``x`` (B, C, ...) as (C, everything else)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _weighted_channel_sums(x, weights):
    """Per-channel sums of ``weights`` (by row) times ``x`` (B, C, ..., H, W), over this rank's part."""
    return _per_channel((x.sum(dim=-1) * weights)).sum(dim=1)

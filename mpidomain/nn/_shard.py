"""What every domain-parallel layer shares: the ranks' extents, the input rows, its wrapped module.

- :func:`layer_extents`: one agreement step (the layer and its settings must be
  the same on every rank) and every rank's extent along the sharded dimension;
- :func:`fetch_rows`: this rank's input rows ``[in_start, in_stop)`` through a
  differentiable halo exchange, with the layer's own padding beyond the edges;
- :class:`Wrapper`: :class:`~mpidomain.nn.DomainParallelModule` (``module.py``), a layer that holds
  the wrapped module as a child yet shows its parameters under the wrapped module's own
  state_dict keys, and runs its forward pre-hooks (spectral_norm, weight_norm).
"""

import torch

from .._agreement import agree
from .._waits import allgather_ints
from .._validate import normalize_dim
from ..manager import library_comm, sharded_dims
from . import ops, plans
from .halo import HaloExchange
from .module import DomainParallelModule as Wrapper

__all__ = ["Wrapper", "fetch_rows", "layer_agree", "layer_extents", "place", "require_covered", "shard_dims",
           "spatial_axis"]


def shard_dims(shard_dim):
    """A layer's ``shard_dim`` (an int, or a pair for tiles) as a tuple of dims.

    The layer's own argument; which dims of ``x`` the manager shards is :func:`mpidomain.manager.sharded_dims`.
    """
    return tuple(shard_dim) if isinstance(shard_dim, (tuple, list)) else (shard_dim,)


def require_covered(manager, x, shard_dim, spatial, name, local):
    """Raise ValueError if ``manager`` shards a spatial dim of ``x`` that the layer's ``shard_dim`` leaves out.

    ``local(axis)`` says whether the layer needs only a row's own input along spatial ``axis``
    (then the dim may stay out). Local; alike on every rank (it depends on the manager and the
    layer alone).
    """
    mine = {spatial_axis(x, d, spatial, name)[0] for d in shard_dims(shard_dim)}
    for s in sharded_dims(manager, x.ndim):
        if s.parts > 1 and s.dim not in mine:
            axis = s.dim - (x.ndim - spatial)
            if 0 <= axis and not local(axis):
                raise ValueError(f"{name}(shard_dim={shard_dim}): the manager shards dim {s.shard_dim} too "
                                 f"({manager.domain_shape} tiles), which this layer would pad on its own; "
                                 f"pass shard_dim={manager.shard_dim} (the manager's)")


def place(manager, x, dim):
    """Return (this rank's tile coordinate along normalised ``dim``, the number of tiles along it); (0, 1) if unsharded."""
    for s in sharded_dims(manager, x.ndim):
        if s.dim == dim:
            return s.coord, s.parts
    return 0, 1


def spatial_axis(x, shard_dim, spatial, name):
    """Return (normalised ``shard_dim`` of ``x``, its index among the last ``spatial`` dims); ValueError if not spatial."""
    dim = normalize_dim(shard_dim, tuple(x.shape), "shard_dim")
    axis = dim - (x.ndim - spatial)
    if axis < 0:
        raise ValueError(f"{name}: shard_dim={shard_dim} is dim {dim} of a {x.ndim}-d input, not one of its last "
                         f"{spatial} (spatial) dims; shard a spatial dim (e.g. -2, latitude)")
    return dim, axis


def layer_agree(manager, name, x, dim, settings, error=None):
    """Agree that every rank runs layer ``name`` with ``settings``; return (this rank's index, group size).

    Collective over the domain group: one agreement step (the same layer,
    settings, dtype and extents but along ``dim`` on every rank, or every rank
    raises; a local ``error`` raises on every rank). Along a dim the manager
    does not shard each rank holds all of it: ``(0, 1)``; with tiles, the
    coordinate and the number of tiles along ``dim``. While Dynamo traces, the
    step runs at trace time (:func:`mpidomain.nn.plans.planned`).
    """
    if error is not None:
        ops.raise_on_every_rank(library_comm(manager), name, error)
    plans.planned(manager, "layer_agree", (name, _description(manager, x, dim, settings)))
    return place(manager, x, dim)


def _description(manager, x, dim, settings):
    """What every rank must pass alike to layer ``name``: its settings, dtype, and extents but the sharded ones."""
    free = {dim, *(s.dim for s in sharded_dims(manager, x.ndim))}
    shape = tuple(None if i in free else int(n) for i, n in enumerate(x.shape))
    return (settings, str(x.dtype), shape, bool(x.requires_grad))


def _agreed(manager, key):
    name, description = key
    agree(library_comm(manager), name, description)
    return True


def layer_extents(manager, name, x, dim, settings, error=None):
    """Return (the extent along ``dim`` of each tile coordinate, this rank's coordinate) for layer ``name``.

    Collective over the domain group: :func:`layer_agree`, then one bounded allgather of two integers
    (``([extent], 0)`` along a dim the manager does not shard). While Dynamo traces, a constant of the
    graph (:func:`mpidomain.nn.plans.planned`).
    """
    if error is not None:
        ops.raise_on_every_rank(library_comm(manager), name, error)
    index, size = place(manager, x, dim)
    key = (name, _description(manager, x, dim, settings), dim, index, size, int(x.shape[dim]))
    return plans.planned(manager, "layer_extents", key)


def _gathered_extents(manager, key):
    name, description, dim, index, size, extent = key
    agree(library_comm(manager), name, description)
    if size == 1:
        return (extent,), 0
    extents = [0] * size
    for coord, theirs in allgather_ints(library_comm(manager), (index, extent), name):
        extents[coord] = theirs  # the tiles of a row (or column) share it
    return tuple(extents), index


plans.register_gather("layer_agree", _agreed)
plans.register_gather("layer_extents", _gathered_extents)


def fetch_rows(x, window, halo, dim, manager, *, edge="zeros", first=True, last=True):
    """Return ``x``'s input rows ``[window.in_start, window.in_stop)`` (global) along ``dim``; differentiable.

    Collective over the domain group (a halo exchange of ``halo`` rows, none if 0).
    Rows beyond the global edges follow ``edge``: ``"zeros"``, ``"circular"``
    (the other end's rows), ``"reflect"`` or ``"replicate"`` (the edge rank's own
    rows; ``first``/``last`` say whether this rank holds an edge).
    """
    padded = HaloExchange(halo, dim, edge == "circular", manager=manager)(x) if halo else x
    start = window.in_start - (window.own_start - halo)
    slab = padded.narrow(dim, start, max(0, window.in_stop - window.in_start))
    if edge not in ("reflect", "replicate"):
        return slab
    # Rows before global row 0 or after the last one are this edge rank's own rows.
    n = x.shape[dim]
    lead = max(0, -window.in_start) if first else 0
    trail = max(0, window.in_stop - window.own_stop) if last else 0
    if not lead and not trail:
        return slab
    pieces = []
    if lead:
        rows = [(-g if edge == "reflect" else 0) for g in range(-lead, 0)]
        pieces.append(x.index_select(dim, torch.tensor(rows, device=x.device)))
    pieces.append(slab.narrow(dim, lead, slab.shape[dim] - lead - trail))
    if trail:
        rows = [(2 * (n - 1) - (g - window.own_start) if edge == "reflect" else n - 1)
                for g in range(window.own_stop, window.own_stop + trail)]
        pieces.append(x.index_select(dim, torch.tensor(rows, device=x.device)))
    return torch.cat(pieces, dim)

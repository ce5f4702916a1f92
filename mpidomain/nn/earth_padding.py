"""CREDIT's ``TensorPadding`` (Earth and mirror padding) on a sharded field, and where its rows go.

CREDIT pads the whole field once at the start of a model (``pad``: beyond each
pole the near rows mirrored half a turn of longitude away, or reflected;
longitude circular) and cuts the pads off at the end (``unpad``). On a
sharded field :class:`DomainParallelTensorPadding` does the same to the
global field:

- ``pad`` pads the edge shards (a halo exchange with ``boundary="earth"``,
  or reflection of the edge rank's own rows) and then re-distributes the
  padded latitude rows so that each rank holds a block that starts at a
  multiple of ``align`` rows: the rows every later stride, window and skip
  connection needs to find whole on one rank (:class:`~mpidomain.nn.Redistribute`,
  an all-to-all over the ranks of one longitude column; its adjoint the move back);
- ``unpad`` re-distributes back to the rows the input came in and drops the
  first ``pad_lat[0]`` and last ``pad_lat[1]`` global rows (and the
  longitude pads).

Along longitude (tiles) the padded tiles must already start at a multiple
of ``align[1]`` (they do for 360 + 76 + 76 on 2 tiles); otherwise it raises on every rank.
:func:`is_tensor_padding` recognises CREDIT's class by what it has (``mode``,
``pad_NS``, ``pad_WE``, ``pad``, ``unpad``), without importing CREDIT.
"""

import torch

from .._agreement import agree
from .._current import require_manager
from .._waits import allgather_ints
from ..manager import library_comm
from ..layout.moves import RowMove, contiguous_layout
from ..layout.tiles import balanced_split
from ._shard import place
from .halo import HaloExchange
from . import ops, plans
from .redistribution import redistribute_rows

__all__ = ["DomainParallelTensorPadding", "is_tensor_padding", "aligned_extents"]

_MODES = ("earth", "mirror")


def is_tensor_padding(obj):
    """True if ``obj`` looks like CREDIT's ``credit.boundary_padding.TensorPadding``."""
    return (getattr(obj, "mode", None) in _MODES and _pair(getattr(obj, "pad_NS", None)) is not None
            and _pair(getattr(obj, "pad_WE", None)) is not None
            and callable(getattr(obj, "pad", None)) and callable(getattr(obj, "unpad", None)))


def _pair(value):
    try:
        before, after = value
    except (TypeError, ValueError):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (before, after)):
        return None
    return int(before), int(after)


# -- Layout arithmetic (no torch, no MPI) -------------------------------------------------------

def aligned_extents(total, parts, align):
    """Split ``total`` rows into ``parts`` blocks of whole ``align``-row groups, balanced; None if impossible."""
    if total % align or total // align < parts:
        return None
    return [n * align for n in balanced_split(total // align, parts)[0]]


@torch.compiler.assume_constant_result
def _row_move(source, target):
    """The :class:`RowMove` from contiguous blocks of ``source`` rows to blocks of ``target``, as its
    :func:`mpidomain.nn.ops.move_handle` (a graph constant)."""
    return ops.move_handle(RowMove(contiguous_layout(source), contiguous_layout(target)))


def _move(y, source, target, manager):
    """Deal ``y``'s latitude rows from extents ``source`` to ``target`` (contiguous blocks); differentiable."""
    return redistribute_rows(y, _row_move(tuple(source), tuple(target)), -2, manager)


def _gathered_layout(manager, key):
    """Agree on ``key``'s description and gather every tile's extents: (latitude extents of this rank's longitude
    column, longitude extents of its latitude band); collective over the domain group."""
    name, description, lat, lats, lon, lons, rows, cols = key
    agree(library_comm(manager), name, description)
    everyone = allgather_ints(library_comm(manager), (lat, lon, rows, cols), name)
    extents = [0] * lats
    for c, o, r, _ in everyone:
        if o == lon:
            extents[c] = r
    lon_extents = [0] * lons
    for c, o, _, n in everyone:
        if c == lat:
            lon_extents[o] = n
    return tuple(extents), tuple(lon_extents)


plans.register_gather("tensor padding layout", _gathered_layout)


class DomainParallelTensorPadding(torch.nn.Module):
    """CREDIT's ``TensorPadding`` (``pad``/``unpad``) on a field sharded in latitude (and longitude).

    Collective over the domain group, forward and backward. ``pad(x)`` takes this
    rank's rows of (..., lat, lon) and returns its rows of the padded global field,
    re-distributed in blocks of ``align[0]`` latitude rows (balanced over the ranks
    of a longitude column); ``unpad(y)`` takes such rows and returns this rank's
    rows of the unpadded field, laid out as the last ``pad`` input was (balanced as
    ``shard_tensor`` cuts them if ``pad`` has not run). Equal to CREDIT's on the
    whole field, cut to the shard. ``forward`` is ``pad``.

    :param mode: ``"earth"`` (fold across the poles, longitude circular) or ``"mirror"``
        (latitude reflected, longitude circular).
    :param pad_lat: (before, after) rows in latitude (``TensorPadding.pad_NS``).
    :param pad_lon: (before, after) columns in longitude (``TensorPadding.pad_WE``).
    :param align: Rows (latitude, longitude) a padded block must start at a multiple of.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, mode="earth", pad_lat=(0, 0), pad_lon=(0, 0), *, align=(1, 1), manager=None):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        pads = [_pair(pad_lat), _pair(pad_lon)]
        if None in pads:
            raise ValueError(f"pad_lat and pad_lon must be pairs of ints >= 0, got {pad_lat!r} and {pad_lon!r}")
        self.mode, self.pad_lat, self.pad_lon = mode, pads[0], pads[1]
        self.align = tuple(int(a) for a in align)
        self.manager = manager
        self._input_extents = {}  # padded global rows -> the latitude extents pad() was given

    @classmethod
    def from_tensor_padding(cls, padding, *, align=(1, 1), manager=None):
        """Return the domain-parallel twin of CREDIT's ``TensorPadding`` object ``padding``."""
        return cls(padding.mode, tuple(padding.pad_NS), tuple(padding.pad_WE), align=align, manager=manager)

    def forward(self, x):
        """Return :meth:`pad` of ``x``."""
        return self.pad(x)

    def _layout(self, x, name):
        """Agree, and return (manager, lat extents, lat index, lon index, lon extents); collective."""
        manager = require_manager(self.manager, name)
        error = None
        if x.ndim < 3:
            error = ValueError(f"{name} pads the last two dims (lat, lon) of (B, C, ..., lat, lon), got {x.ndim}-d")
        elif tuple(manager.shard_dims) not in ((-2,), (-2, -1)):
            error = ValueError(f"{name} needs a manager sharding latitude (shard_dim=-2) or tiles (-2, -1), got "
                               f"shard_dim={manager.shard_dim}")
        if error is not None:
            ops.raise_on_every_rank(library_comm(manager), name, error)
        shape = tuple(int(n) for n in x.shape[:-2]) + (None, None)
        description = (self.mode, self.pad_lat, self.pad_lon, self.align, str(x.dtype), shape)
        lat, lats = place(manager, x, x.ndim - 2)
        lon, lons = place(manager, x, x.ndim - 1)
        key = (name, description, lat, lats, lon, lons, int(x.shape[-2]), int(x.shape[-1]))
        extents, lon_extents = plans.planned(manager, "tensor padding layout", key)
        return manager, list(extents), lat, lon, list(lon_extents)

    def pad(self, x):
        """Return this rank's rows of the padded global field, in ``align``-row blocks; collective."""
        name = "DomainParallelTensorPadding.pad"
        manager, extents, lat, lon, lon_extents = self._layout(x, name)
        lats, lons = len(extents), len(lon_extents)
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        padded_rows = sum(extents) + top + bottom
        target = aligned_extents(padded_rows, lats, self.align[0])
        problem = None
        if target is None:
            problem = (f"{padded_rows} padded latitude rows cannot be cut into {lats} blocks of whole "
                       f"{self.align[0]}-row groups (the model's strides and windows); use at most "
                       f"{padded_rows // self.align[0]} latitude ranks")
        elif max(top, bottom) > min(extents) or (self.mode == "mirror" and max(top, bottom) >= min(extents)):
            problem = (f"pad_lat={self.pad_lat} needs more rows than the smallest shard of {extents} holds; use fewer "
                       "latitude ranks")
        elif lons > 1:
            starts = [left + sum(lon_extents[:o]) for o in range(lons)]
            if any(s % self.align[1] for s in starts[1:]) or max(left, right) > min(lon_extents):
                problem = (f"longitude tiles of {lon_extents} columns padded by {self.pad_lon} start at "
                           f"{starts}, not all multiples of {self.align[1]}; choose D_lon so they do")
        if problem:  # every rank computed the same layout: the same error everywhere
            raise ValueError(f"{name}(mode={self.mode!r}, pad_lat={self.pad_lat}, pad_lon={self.pad_lon}): {problem}")
        self._input_extents[padded_rows] = list(extents)
        y = self._pad_in_place(x, manager, lat == 0, lat == lats - 1, lon == 0, lon == lons - 1, lons > 1)
        local = [n + (top if c == 0 else 0) + (bottom if c == lats - 1 else 0) for c, n in enumerate(extents)]
        if local == target:
            return y
        return _move(y, local, target, manager)

    def _pad_in_place(self, x, manager, first, last, west, east, lon_tiled):
        """Pad the global edges of this rank's tile (its own rows stay where they are)."""
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        hlat, hlon = max(top, bottom), max(left, right)
        if self.mode == "earth":
            if not (hlat or hlon):
                return x
            y = HaloExchange((hlat, hlon), dim=(-2, -1), boundary="earth", manager=manager)(x)
            return _trim(y, hlat, hlon, top if first else 0, bottom if last else 0,
                         left if west else 0, right if east else 0)
        # mirror: longitude circular, then latitude reflected at the poles from the edge ranks' own rows
        if hlon:
            if lon_tiled:
                y = HaloExchange(hlon, dim=-1, periodic=True, manager=manager)(x)
                x = y.narrow(-1, hlon - (left if west else 0),
                             x.shape[-1] + (left if west else 0) + (right if east else 0))
            else:
                x = torch.cat([x[..., x.shape[-1] - left:], x, x[..., :right]], dim=-1)
        pieces = []
        n = x.shape[-2]
        if first and top:
            pieces.append(x.index_select(-2, torch.arange(top, 0, -1, device=x.device)))
        pieces.append(x)
        if last and bottom:
            pieces.append(x.index_select(-2, torch.arange(n - 2, n - 2 - bottom, -1, device=x.device)))
        return torch.cat(pieces, dim=-2) if len(pieces) > 1 else x

    def unpad(self, y):
        """Return this rank's rows of the unpadded field, laid out as :meth:`pad`'s input; collective."""
        name = "DomainParallelTensorPadding.unpad"
        manager, extents, lat, lon, lon_extents = self._layout(y, name)
        lats, lons = len(extents), len(lon_extents)
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        padded_rows = sum(extents)
        inputs = self._input_extents.get(padded_rows)
        if inputs is None:  # no pad() of this size yet: the rows as shard_tensor deals them
            inputs = list(balanced_split(max(0, padded_rows - top - bottom), lats)[0])
        local = [n + (top if c == 0 else 0) + (bottom if c == lats - 1 else 0) for c, n in enumerate(inputs)]
        if local != list(extents):
            y = _move(y, extents, local, manager)
        first, last, west, east = lat == 0, lat == lats - 1, lon == 0, lon == lons - 1
        cut_top, cut_bottom = (top if first else 0), (bottom if last else 0)
        cut_left, cut_right = (left if west else 0), (right if east else 0)
        y = y.narrow(-2, cut_top, y.shape[-2] - cut_top - cut_bottom)
        return y.narrow(-1, cut_left, y.shape[-1] - cut_left - cut_right)

    def extra_repr(self):
        return f"mode={self.mode!r}, pad_lat={self.pad_lat}, pad_lon={self.pad_lon}, align={self.align}"


def _trim(y, hlat, hlon, top, bottom, left, right):
    """Keep ``top``/``bottom`` of the ``hlat`` halo rows and ``left``/``right`` of the ``hlon`` columns."""
    y = y.narrow(-2, hlat - top, y.shape[-2] - 2 * hlat + top + bottom)
    return y.narrow(-1, hlon - left, y.shape[-1] - 2 * hlon + left + right)

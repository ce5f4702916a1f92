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
from ._compile_marks import constant_result
from ._shard import place
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .rows import ceil_div
from . import ops, plans
from .redistribution import redistribute_rows

__all__ = ["DomainParallelTensorPadding", "is_tensor_padding", "aligned_extents", "padded_extents", "BALANCE"]

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

def _wider_than_a_shard(mode, top, bottom, extents):
    """True where a pad needs rows beyond the edge shard (mirror reflects about the edge row: one more)."""
    extra = mode == "mirror"
    return (top and top + extra > extents[0]) or (bottom and bottom + extra > extents[-1]) or \
        max(top, bottom) > min(extents)


def edge_extents(extents, top, bottom):
    """Return contiguous extents of the same rows in which the first rank holds at least ``top`` rows and the
    last one holding rows at least ``bottom``, the others' rows balanced between them; where ``top + bottom``
    exceeds the rows, the first rank holds them all."""
    total, parts = sum(extents), len(extents)
    if parts == 1 or top + bottom > total:
        return [total] + [0] * (parts - 1)
    first, final = max(extents[0], top), max(extents[-1], bottom)
    if first + final > total:
        first, final = top, total - top
    middle = list(balanced_split(total - first - final, parts - 2)[0]) if parts > 2 else []
    return [first] + middle + [final]


#: The largest block :func:`padded_extents` accepts from a coarser alignment, against an even share.
BALANCE = 1.15


def aligned_extents(total, parts, align):
    """Split ``total`` rows into ``parts`` blocks of whole ``align``-row groups, balanced, the rows past the last
    whole group (``total % align``) with the last block; None if there are fewer groups than ``parts``."""
    groups, rest = divmod(total, align)
    if groups < parts:
        return None
    blocks = [n * align for n in balanced_split(groups, parts)[0]]
    blocks[-1] += rest
    return blocks


def padded_extents(total, parts, align, prefer=()):
    """Return ``(extents, alignment)``: ``total`` rows in ``parts`` blocks (:func:`aligned_extents`) of the
    coarsest alignment in ``prefer`` whose largest block is at most :data:`BALANCE` times an even share, else
    of ``align`` (what the model needs; each of ``prefer`` is a multiple of it); ``(None, align)`` if even
    ``align`` has fewer groups than parts."""
    for coarse in sorted(set(prefer), reverse=True):
        extents = aligned_extents(total, parts, coarse)
        if extents is not None and max(extents) <= BALANCE * total / parts:
            return extents, coarse
    return aligned_extents(total, parts, align), align


@constant_result
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
    :param align: Rows (latitude, longitude) a padded block must start at a multiple of (the model's strides).
    :param prefer: Coarser latitude alignments (multiples of ``align[0]``) to deal the blocks in where they stay
        balanced (:func:`padded_extents`): e.g. whole windows of the early stages, so that their attention moves
        no rows.
    :param resize: ``(height, width)`` that :meth:`unpad` resamples its output to (bilinear, as CREDIT's
        CrossFormer ``interp``) where the model gives back fewer rows than it was padded to (801 padded rows
        through stride-2 stages come back as 800); None: the rows must come back whole.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    """

    def __init__(self, mode="earth", pad_lat=(0, 0), pad_lon=(0, 0), *, align=(1, 1), prefer=(), resize=None,
                 manager=None):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        pads = [_pair(pad_lat), _pair(pad_lon)]
        if None in pads:
            raise ValueError(f"pad_lat and pad_lon must be pairs of ints >= 0, got {pad_lat!r} and {pad_lon!r}")
        self.mode, self.pad_lat, self.pad_lon = mode, pads[0], pads[1]
        self.align = tuple(int(a) for a in align)
        self.prefer = tuple(int(a) for a in prefer)
        if any(a % self.align[0] for a in self.prefer):
            raise ValueError(f"prefer={self.prefer}: every preferred alignment must be a multiple of align[0] = "
                             f"{self.align[0]}")
        self.resize = None if resize is None else tuple(int(n) for n in resize)
        self.manager = manager
        self._input_extents = {}  # padded global rows -> the latitude extents pad() was given
        self._last_input = None  # (padded rows, the latitude extents, padded columns) of the last pad()

    @classmethod
    def from_tensor_padding(cls, padding, *, align=(1, 1), prefer=(), resize=None, manager=None):
        """Return the domain-parallel twin of CREDIT's ``TensorPadding`` object ``padding``."""
        return cls(padding.mode, tuple(padding.pad_NS), tuple(padding.pad_WE), align=align, prefer=prefer,
                   resize=resize, manager=manager)

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

    def layout_problem(self, extents, lon_extents=(0,)):
        """Return why :meth:`pad` refuses shards of ``extents`` latitude rows (each latitude band's) and
        ``lon_extents`` columns, or None. Local and pure: every rank finds the same."""
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        lats, lons = len(extents), len(lon_extents)
        padded_rows = sum(extents) + top + bottom
        groups = padded_rows // self.align[0]
        if padded_extents(padded_rows, lats, self.align[0], self.prefer)[0] is None:
            return (f"{padded_rows} padded latitude rows hold {groups} whole {self.align[0]}-row groups (the "
                    f"product of the model's strides), fewer than the {lats} latitude ranks; use at most {groups} "
                    "latitude ranks")
        if _wider_than_a_shard(self.mode, top, bottom, extents) and lons > 1:
            return (f"pad_lat={self.pad_lat} needs more rows than the smallest shard of {list(extents)} holds, and "
                    "the longitude tiles fold the poles across tiles; use fewer latitude ranks or D_lon = 1")
        if lons > 1:
            starts = [left + sum(lon_extents[:o]) for o in range(lons)]
            if any(s % self.align[1] for s in starts[1:]) or max(left, right) > min(lon_extents):
                return (f"longitude tiles of {list(lon_extents)} columns padded by {self.pad_lon} start at "
                        f"{starts}, not all multiples of {self.align[1]}; choose D_lon so they do")
        return None

    def check_layout(self, rows, columns, domain_shape):
        """Return None, or one line: why a ``rows x columns`` field dealt over ``domain_shape`` (``(D,)``
        latitude slabs or ``(D_lat, D_lon)`` tiles, cut as ``shard_tensor`` cuts them) cannot be padded, and
        which layouts can. Local and pure: call it before any data are read."""
        lats, lons = (tuple(domain_shape) + (1,))[:2]
        lon_extents = balanced_split(columns, lons)[0]
        problem = self.layout_problem(balanced_split(rows, lats)[0], lon_extents)
        if problem is None:
            return None
        works = [d for d in range(1, rows + 1)
                 if self.layout_problem(balanced_split(rows, d)[0], lon_extents) is None]
        ranges, start = [], None
        for d in works + [None]:
            if start is None:
                start = previous = d
            elif d != previous + 1:
                ranges.append(str(start) if start == previous else f"{start}-{previous}")
                start = previous = d
            else:
                previous = d
        said = ", ".join(ranges) if ranges else "none"
        return f"{problem} (latitude ranks that work{' with D_lon = %d' % lons if lons > 1 else ''}: {said})"

    def pad(self, x):
        """Return this rank's rows of the padded global field, in ``align``-row blocks; collective."""
        name = "DomainParallelTensorPadding.pad"
        manager, extents, lat, lon, lon_extents = self._layout(x, name)
        lats, lons = len(extents), len(lon_extents)
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        padded_rows = sum(extents) + top + bottom
        target, _ = padded_extents(padded_rows, lats, self.align[0], self.prefer)
        problem = self.layout_problem(extents, lon_extents)
        if problem:  # every rank computed the same layout: the same error everywhere
            raise ValueError(f"{name}(mode={self.mode!r}, pad_lat={self.pad_lat}, pad_lon={self.pad_lon}): {problem}")
        self._input_extents[padded_rows] = list(extents)
        self._last_input = (padded_rows, list(extents), sum(lon_extents) + left + right)
        if _wider_than_a_shard(self.mode, top, bottom, extents):
            # The pads span more than the edge shards: the edge rows gathered on the edge ranks first (a move),
            # then padded there, as one process pads them (slabs: the whole longitude is on every rank).
            edges = edge_extents(extents, top + (self.mode == "mirror"), bottom + (self.mode == "mirror"))
            x = _move(x, extents, edges, manager)
            last = max(c for c, n in enumerate(edges) if n)
            y = self._pad_slab(x, manager, lat == 0, lat == last)
            local = [n + (top if c == 0 else 0) + (bottom if c == last else 0) for c, n in enumerate(edges)]
            return y if local == target else _move(y, local, target, manager)
        y = self._pad_in_place(x, manager, lat == 0, lat == lats - 1, lon == 0, lon == lons - 1, lons > 1)
        local = [n + (top if c == 0 else 0) + (bottom if c == lats - 1 else 0) for c, n in enumerate(extents)]
        if local == target:
            return y
        return _move(y, local, target, manager)

    def _pad_slab(self, x, manager, first, last):
        """Pad this rank's rows of a slab (the whole longitude here) as CREDIT pads the whole field: the top pad
        where ``first``, the bottom pad where ``last`` (this rank holds the rows each is made of). Local."""
        if self.mode == "mirror":  # from the rank's own rows already (the tiles' path, without tiles)
            return self._pad_in_place(x, manager, first, last, True, True, False)
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        half, n = x.shape[-1] // 2, x.shape[-2]  # beyond each pole the near rows, half a turn away, mirrored
        pieces = [torch.flip(torch.roll(x[..., :top, :], half, -1), (-2,))] if first and top else []
        pieces.append(x)
        if last and bottom:
            pieces.append(torch.flip(torch.roll(x[..., n - bottom:, :], half, -1), (-2,)))
        x = torch.cat(pieces, dim=-2) if len(pieces) > 1 else x
        if left or right:  # longitude circular
            x = torch.cat([x[..., x.shape[-1] - left:], x, x[..., :right]], dim=-1)
        return x

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
        padded_rows, last = sum(extents), self._last_input
        if last is not None and (padded_rows, sum(lon_extents)) == (last[0], last[2]):
            inputs = last[1]  # the rows and columns came back whole: the last pad()'s
        elif last is not None and self.resize is not None:  # fewer came back: resampled to resize
            return self._unpad_resized(y, manager, extents, lat, lon, lon_extents, last)
        else:
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

    def _unpad_resized(self, y, manager, extents, lat, lon, lon_extents, last):
        """:meth:`unpad` of a model that gave back fewer rows than it was padded to: the pads cut from the
        global rows, the rest resampled to ``resize`` (bilinear, as CREDIT's ``F.interpolate``) and dealt as
        the last :meth:`pad`'s input; collective."""
        name = "DomainParallelTensorPadding.unpad"
        (top, bottom), (left, right) = self.pad_lat, self.pad_lon
        total, lons = sum(extents), len(lon_extents)
        starts = [sum(extents[:c]) for c in range(len(extents))]
        kept = [max(0, min(s + e, total - bottom) - max(s, top)) for s, e in zip(starts, extents)]
        columns = sum(lon_extents) - left - right
        problem = None
        if sum(last[1]) != self.resize[0]:
            problem = (f"the model's input had {sum(last[1])} rows, but its output is resampled to "
                       f"image_height {self.resize[0]}; give the model fields of image_height rows")
        elif lons > 1 and columns != self.resize[1]:
            problem = (f"the model gave back {columns} columns inside the pads, not {self.resize[1]}, on "
                       f"longitude tiles; resampling across longitude tiles is not built: use D_lon = 1")
        if problem:  # every rank computed the same layout
            raise ValueError(f"{name}(resize={self.resize}): {problem}")
        y = y.narrow(-2, min(max(starts[lat], top) - starts[lat], y.shape[-2]), kept[lat])
        cut_left, cut_right = (left if lon == 0 else 0), (right if lon == lons - 1 else 0)
        y = y.narrow(-1, cut_left, y.shape[-1] - cut_left - cut_right)
        if min(kept) < 2:  # a block (nearly) all pad: the kept rows balanced first, each with a neighbour's tap
            balanced = list(balanced_split(sum(kept), len(kept))[0])
            y, kept = _move(y, kept, balanced, manager), balanced
        y = DomainParallelInterpolate(size=self.resize, mode="bilinear", shard_dim=manager.shard_dim,
                                      manager=manager)(y)
        rows, target = sum(kept), self.resize[0]  # the resampled rows of rank c: [ceil(a*M/N), ceil(b*M/N))
        bounds = [0] + [ceil_div(sum(kept[:c + 1]) * target, rows) for c in range(len(kept) - 1)] + [target]
        resampled = [b - a for a, b in zip(bounds, bounds[1:])]
        return y if resampled == last[1] else _move(y, resampled, last[1], manager)

    def extra_repr(self):
        return (f"mode={self.mode!r}, pad_lat={self.pad_lat}, pad_lon={self.pad_lon}, align={self.align}"
                + (f", prefer={self.prefer}" if self.prefer else "") + (f", resize={self.resize}" if self.resize
                                                                         else ""))


def _trim(y, hlat, hlon, top, bottom, left, right):
    """Keep ``top``/``bottom`` of the ``hlat`` halo rows and ``left``/``right`` of the ``hlon`` columns."""
    y = y.narrow(-2, hlat - top, y.shape[-2] - 2 * hlat + top + bottom)
    return y.narrow(-1, hlon - left, y.shape[-1] - 2 * hlon + left + right)

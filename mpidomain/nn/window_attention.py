"""Window attention (CREDIT's CrossFormer ``Attention``) on a sharded field, exact: whole windows per rank.

Every window of a windowed attention is independent, so the wrapped module's
own forward is exact on any local field that holds whole windows in the order
its rearrange expects. :class:`DomainParallelWindowAttention` re-deals the rows
of the sharded dims (one all-to-all, over both dims of tiles at once, :class:`~mpidomain.nn.Redistribute`)
so that every rank holds whole windows, runs the module unchanged, and sends
the output rows back to their owners; backward is the exact adjoint. Short-range
windows (``"short"``: ``window`` neighbouring rows) and long-range ones
(``"long"``: rows spaced ``extent // window`` apart across the whole field)
differ only in the layout (:mod:`mpidomain.layout.moves`).

:func:`window_attention_spec` recognises such a module by what it has
(``attn_type`` "short" or "long", ``window_size``, ``to_qkv``, ``to_out``,
``rel_pos_indices``), never by importing CREDIT.
"""

import warnings
from dataclasses import dataclass

import torch

from .._validate import is_int
from ..manager import library_comm, sharded_dims
from ..layout.moves import WINDOW_KINDS, window_move, window_numbers
from ._compile_marks import constant_result
from ._shard import Wrapper, layer_extents, place, shard_dims
from . import ops
from .redistribution import inverse_move, redistribute_rows
from .rng import check_rng, dropout_draw, memory_order, tile_dropout

__all__ = ["DomainParallelWindowAttention", "WindowAttentionSpec", "window_attention_spec"]

_NAME = "DomainParallelWindowAttention"


@dataclass(frozen=True)
class WindowAttentionSpec:
    """What a windowed attention module computes over: ``kind`` ("short" or "long") windows of ``window_size``."""

    kind: str
    window_size: int


def window_attention_spec(module):
    """Return the :class:`WindowAttentionSpec` of a windowed attention module, or None if it is not one.

    Local. A module is one if it has ``attn_type`` "short" or "long", an int
    ``window_size`` >= 1, the submodules ``to_qkv`` and ``to_out`` and the
    ``rel_pos_indices`` of a relative position bias: CREDIT's CrossFormer
    ``Attention``, which attends within ``window_size x window_size`` windows of
    neighbouring pixels ("short") or of pixels spaced ``H / window_size`` and
    ``W / window_size`` apart across the whole field ("long").
    """
    kind, window = getattr(module, "attn_type", None), getattr(module, "window_size", None)
    if not isinstance(kind, str) or kind not in WINDOW_KINDS or not is_int(window) or window < 1:
        return None
    if not all(isinstance(getattr(module, name, None), torch.nn.Module) for name in ("to_qkv", "to_out")):
        return None
    if not isinstance(getattr(module, "rel_pos_indices", None), torch.Tensor):
        return None
    return WindowAttentionSpec(kind, int(window))


@constant_result
def _window_moves(kind, window, along):
    """Return (((dim, move, its inverse), ...), None), or ((), the error's message): the moves (as
    :func:`mpidomain.nn.ops.move_handle` numbers) that give every
    rank whole ``kind`` windows of ``window`` rows along each ``(dim, every rank's extents)`` of ``along``.

    None along a dim whose shards hold whole windows in order already; with tiles and both dims moving, one
    pair of moves over both. Local: a constant of a compiled graph.
    """
    moves = []
    for dim, extents in along:
        try:
            move = window_move(kind, extents, window)
        except ValueError as exc:
            return (), f"{_NAME} along dim {dim - 4} (extents {extents}): {exc}"
        if move.source != move.target:  # shards of whole windows already (alike on every rank): nothing moves
            moves.append((dim, move))
    if len(moves) == 2 and moves[1][0] == moves[0][0] + 1:  # tiles, both dims: one all-to-all, not two
        moves = [(tuple(dim for dim, _ in moves), tuple(move for _, move in moves))]
    return tuple((dim, ops.move_handle(move), ops.move_handle(inverse_move(move))) for dim, move in moves), None


class DomainParallelWindowAttention(Wrapper):
    """A windowed attention module on a sharded (B, C, H, W) field, equal to the module on the whole field.

    Collective over the domain group, forward and backward: each rank passes its
    shard (slabs or tiles, uneven extents allowed, as ``shard_tensor`` cuts
    them) and gets its rows of the single-process output. Along each dim the
    manager shards, the rows are re-dealt so that every rank holds whole windows
    (blocks of whole windows for ``"short"``; whole long-range groups, ``l1``-major,
    for ``"long"``: :mod:`mpidomain.layout.moves`), the wrapped module's
    own forward runs on them, and the output rows return to their owners
    (one all-to-all each way: along the one dim that needs it, or with tiles
    over both dims at once, each pixel sent straight to its window's rank;
    none along a dim whose shards already hold whole windows in order, e.g.
    short windows on aligned shards).
    A rank dealt no window (more ranks than windows along a dim) runs the module
    on an empty batch, so its parameter gradients are zeros, not None. Parameter gradients are this rank's share:
    sum them over the domain group (``allreduce_gradients(..., group="domain",
    op="sum")``) for the single-process gradients. The state_dict keys are the
    module's own.

    Its ``nn.Dropout`` children (CREDIT's attention-weight dropout) draw as ``rng`` says
    (:mod:`mpidomain.nn.rng`): ``"tile"``, each rank its windows' masks from its own stream;
    ``"one-process"``, every rank the attention weights' mask of all the windows of the field, as one
    process draws it, keeping its own windows' part (one process's attention weights, transient).

    A sharded dim whose extent ``window_size`` does not divide raises the same
    ValueError on every rank.

    :param module: The attention module (e.g. CREDIT's CrossFormer ``Attention``); kept as ``.module``.
    :param window_size: Window size; default the module's (:func:`window_attention_spec`).
    :param kind: ``"short"`` or ``"long"``; default the module's ``attn_type``.
    :param shard_dim: The sharded dims; default (None) the manager's; must be the manager's if given.
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param rng: How its dropout draws: ``"tile"`` (default) or ``"one-process"``.
    """

    def __init__(self, module, window_size=None, kind=None, shard_dim=None, manager=None, rng="tile"):
        spec = window_attention_spec(module)
        if window_size is None or kind is None:
            if spec is None:
                raise TypeError(f"{_NAME}: {type(module).__name__} does not say its window (no attn_type 'short' or "
                                "'long' with window_size, to_qkv, to_out and rel_pos_indices); pass window_size= "
                                "and kind=")
            window_size = spec.window_size if window_size is None else window_size
            kind = spec.kind if kind is None else kind
        if kind not in WINDOW_KINDS:
            raise ValueError(f"{_NAME}: kind must be 'short' or 'long', got {kind!r}")
        if not is_int(window_size) or window_size < 1:
            raise ValueError(f"{_NAME}: window_size must be an int >= 1, got {window_size!r}")
        super().__init__(module, shard_dim, manager)
        self.window_size, self.kind, self.rng = int(window_size), kind, check_rng(rng)
        self._draws = _Draws(self.rng, self.window_size)
        for parent in list(module.modules()):
            for name, child in list(parent._modules.items()):
                if type(child) is torch.nn.Dropout:
                    parent._modules[name] = _WindowDropout(child.p, child.inplace, self._draws)

    def _check(self, x, manager):
        """This rank's sharded dims of ``x`` (normalised); TypeError/ValueError for a local mistake."""
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{_NAME} expects a (B, C, H, W) tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if self.shard_dim is not None and shard_dims(self.shard_dim) != shard_dims(manager.shard_dim):
            raise ValueError(f"{_NAME}(shard_dim={self.shard_dim}): the manager shards {manager.shard_dim}; the "
                             f"windows span every sharded dim, so pass shard_dim=None or {manager.shard_dim}")
        sharded = sharded_dims(manager, 4)
        for d, parts in zip(manager.shard_dims, manager.domain_shape):
            if parts > 1 and not any(s.shard_dim == d and s.dim >= 2 for s in sharded):
                raise ValueError(f"{_NAME}: the manager shards dim {d}, not latitude or longitude (-2, -1) of "
                                 f"the (B, C, H, W) input; shard latitude or longitude")
        return [s.dim for s in sharded if s.dim >= 2]

    def forward(self, x):
        """Return this rank's rows of the module's output on the whole field; collective over the domain group."""
        manager = self._manager()
        settings = (type(self.module).__name__, self.kind, self.window_size)
        try:
            dims = self._check(x, manager)
        except (TypeError, ValueError) as error:
            ops.raise_on_every_rank(library_comm(manager), _NAME, error)  # the others meet it in layer_extents
        along = []  # (dim, every rank's extents along it)
        for dim in dims:
            if place(manager, x, dim)[1] > 1:
                along.append((dim, tuple(layer_extents(manager, _NAME, x, dim, settings)[0])))
        moves, error = _window_moves(self.kind, self.window_size, tuple(along))
        if error is not None:  # the same on every rank (the extents were gathered), settled before raising
            ops.raise_on_every_rank(library_comm(manager), _NAME + " layout", ValueError(error))
        for dim, move, _ in moves:
            x = redistribute_rows(x, move, dim, manager)
        self._draws.manager = manager
        if self.rng == "one-process" and self.training:
            self._draws.windows = self._window_batch(x, dict(along), manager)
        try:
            y = self._run(x)
        finally:
            self._draws.manager, self._draws.windows = None, None
        for dim, _, back in reversed(moves):
            y = redistribute_rows(y, back, dim, manager)
        return y

    def _window_batch(self, x, along, manager):
        """Return (the windows' batch on one process, the index of this rank's windows in it): the module's
        ``(b h w)`` batch of its windows, numbered as one process numbers the whole field's. Local."""
        numbers = []
        for dim in (2, 3):
            if dim in along:  # sharded: the rows the window move dealt this rank (its own, if whole already)
                extents, coord = along[dim], place(manager, x, dim)[0]
                rows = window_move(self.kind, extents, self.window_size).target.rows_of(coord)
                extent = sum(extents)
            else:
                rows, extent = range(x.shape[dim]), x.shape[dim]
            numbers.append((torch.tensor(window_numbers(self.kind, rows, extent, self.window_size),
                                         dtype=torch.int64), extent // self.window_size))
        (rows, across), (cols, down) = numbers
        batch = torch.arange(x.shape[0]).view(-1, 1, 1)
        index = ((batch * across + rows.view(1, -1, 1)) * down + cols.view(1, 1, -1)).reshape(-1)
        return x.shape[0] * across * down, index.to(x.device)

    def _run(self, x):
        """The module on whole windows; on no rows, on an empty batch of one window's shape (still in the graph)."""
        if x.shape[-2] and x.shape[-1]:
            return self.module(x)
        window = self.window_size
        with warnings.catch_warnings():  # statistics of no element (a LayerNorm's var) warn; nothing is computed
            warnings.simplefilter("ignore", UserWarning)
            out = self.module(x.reshape(0, x.shape[1], window, window))
        return out.reshape(x.shape[0], out.shape[1], x.shape[2], x.shape[3])

    def extra_repr(self):
        return f"kind={self.kind!r}, window_size={self.window_size}, shard_dim={self.shard_dim}, rng={self.rng!r}"


class _Draws:
    """How a window attention's dropouts draw: ``rng``, the window size, and during its forward the manager and
    (``"one-process"``) the windows' batch on one process with this rank's windows' index in it."""

    def __init__(self, rng, window_size):
        self.rng, self.window_size = rng, window_size
        self.manager = self.windows = None

    def __deepcopy__(self, memo):
        return _Draws(self.rng, self.window_size)  # never the manager (communicators) or a forward's windows


class _WindowDropout(torch.nn.Module):
    """An ``nn.Dropout`` of the attention weights inside a :class:`DomainParallelWindowAttention` (its ``_draws``);
    outside the wrapper's forward (the module run alone), torch's own dropout."""

    def __init__(self, p, inplace, draws):
        super().__init__()
        self.p, self.inplace, self._draws = p, inplace, draws

    def forward(self, x):
        draws = self._draws
        if not self.training or self.p == 0:
            return x
        if draws.manager is None:
            return torch.nn.functional.dropout(x, self.p, True, self.inplace)
        if draws.rng == "tile":
            return tile_dropout(x, self.p, False, self.inplace, draws.manager)
        weights = draws.window_size ** 2
        if x.ndim != 4 or tuple(x.shape[2:]) != (weights, weights):  # alike on every rank: heads and windows
            raise ValueError(f"{_NAME}: rng='one-process' reproduces the dropout of the attention weights (batch, "
                             f"heads, {weights}, {weights}) only, got a dropout of shape {tuple(x.shape)}; use "
                             "rng='tile'")
        count, index = draws.windows
        order = memory_order(draws.manager, _NAME, x, (0,))
        return dropout_draw(x, self.p, False, self.inplace, (count,) + tuple(x.shape[1:]),
                            lambda noise: noise.index_select(0, index), order)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"

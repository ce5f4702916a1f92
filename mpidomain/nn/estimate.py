"""Activation bytes per rank before launch: :func:`estimate_memory`, from one forward on the meta device.

The unconverted model runs once on ``torch.device("meta")`` tensors (shapes, no data, no
communication) under a saved-tensors hook and forward hooks, so every storage autograd keeps
for backward is known with the module that saved it. A copy converted as
:func:`~mpidomain.nn.convert_to_domain_parallel` converts it (on the meta device too) says what
each layer becomes, and each saved storage is scaled to what the converted layer keeps on each
rank of the domain group:

- a tensor whose bytes grow with the batch (a field): the rank's rows and columns of it at its
  resolution, as the converted model deals them out: balanced shards as ``shard_tensor`` cuts
  the input; inside a model that pads the field (CREDIT's CrossFormer) the aligned blocks
  :class:`~mpidomain.nn.DomainParallelTensorPadding` deals; inside window attention, the whole
  windows :class:`~mpidomain.nn.DomainParallelWindowAttention` deals the rank;
- the input of a converted convolution: the rank's rows plus the halo rows the layer exchanges
  (the storage it keeps), from the row arithmetic the layer itself runs (:mod:`mpidomain.nn.rows`);
- anything else (weights spectral norm computes, position-bias tables, index buffers): whole,
  on every rank.

Each storage counts once, whole, as :class:`~mpidomain.nn.SavedActivations` counts it. Other converted
layers (pools, interpolation, pixel unshuffle, batch norm) count as their rows' share, without the halo
rows a pool or an interpolation exchanges.
"""

import copy
import functools
import itertools
import math
from dataclasses import dataclass

import torch

from .._validate import is_int
from ..manager import domain_layout
from ..layout.moves import window_move
from ..layout.tiles import balanced_split
from . import rows
from ._shard import Wrapper, shard_dims
from .conv import DomainParallelPeriodicConv2d, _ForwardConv, _TransposedConv
from .convert import convert_to_domain_parallel
from .earth_padding import DomainParallelTensorPadding, padded_extents
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .redistribution import Redistribute
from .window_attention import DomainParallelWindowAttention

__all__ = ["DrawEstimate", "MemoryEstimate", "estimate_draws", "estimate_memory"]


@dataclass(frozen=True)
class MemoryEstimate:
    """What :func:`estimate_memory` predicts: activation bytes saved for backward by one training forward.

    ``bytes_per_rank`` is the largest rank's (``largest_rank``, a domain rank); ``rank_bytes`` every
    domain rank's, in domain-rank order; ``one_process_bytes`` the unconverted model's on the whole
    field; ``tile_shape`` the largest rank's input tile; ``domain_shape`` ``(D,)`` for latitude slabs,
    ``(D_lat, D_lon)`` for tiles.
    """

    input_shape: tuple
    domain_shape: tuple
    tile_shape: tuple
    bytes_per_rank: int
    largest_rank: int
    rank_bytes: tuple
    one_process_bytes: int

    @property
    def ratio(self):
        """``bytes_per_rank / one_process_bytes``: the share of one process's activations the largest rank keeps."""
        return self.bytes_per_rank / self.one_process_bytes if self.one_process_bytes else 0.0

    def __str__(self):
        layout = "x".join(str(d) for d in self.domain_shape)
        kind = "tiles" if len(self.domain_shape) == 2 else "slabs"
        return (f"activations saved for backward, D={layout} ({kind}), input {tuple(self.input_shape)}: "
                f"{self.bytes_per_rank / 2**20:.1f} MiB on the largest rank (domain rank {self.largest_rank}, tile "
                f"{tuple(self.tile_shape)}), {self.ratio:.3f} of one process's "
                f"{self.one_process_bytes / 2**20:.1f} MiB")


def _storage_key(tensor):
    """The identity of ``tensor``'s storage (views share it); meta storages have no data pointer."""
    return tensor.untyped_storage()._cdata


def _meta_copy(model):
    """A deep copy of ``model`` whose tensors live on the meta device (no bytes copied)."""
    memo = {}
    for module in model.modules():
        for tensor in module._parameters.values():
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = torch.nn.Parameter(torch.empty_like(tensor, device="meta"),
                                                      requires_grad=tensor.requires_grad)
        tensors = list(module._buffers.values()) + [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for tensor in tensors:
            if tensor is not None and id(tensor) not in memo:
                memo[id(tensor)] = torch.empty_like(tensor, device="meta")
    return copy.deepcopy(model, memo)


def _first_tensor(args):
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg
        if isinstance(arg, (tuple, list)):
            found = _first_tensor(arg)
            if found is not None:
                return found
    return None


class _Frame:
    """One module call during the recording: its path, its input's sizes along the sharded dims, its storage."""

    __slots__ = ("path", "sizes", "key")

    def __init__(self, path, x, dims):
        self.path = path
        self.sizes = tuple(int(x.shape[d]) for d in dims) if x is not None and x.ndim >= 3 else None
        self.key = _storage_key(x) if x is not None else None


def _record(model, x, dims, excluded):
    """Run ``model(x)`` (meta); return {storage key: [bytes, [(shape, frames, is the innermost module's input)]]}
    in first-saved order (frames outermost first)."""
    stack, saved = [], {}

    def pack(tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
            return tensor
        key = _storage_key(tensor)
        if key in excluded:
            return tensor
        entry = saved.setdefault(key, [0, []])
        entry[0] = max(entry[0], tensor.untyped_storage().nbytes())
        entry[1].append((tuple(tensor.shape), tuple(stack), bool(stack) and stack[-1].key == key))
        return tensor

    def enter(path, module, args):
        stack.append(_Frame(path, _first_tensor(args), dims))

    def leave(path, module, args, output):
        if stack and stack[-1].path == path:
            stack.pop()

    handles = []
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(functools.partial(enter, path)))
            handles.append(module.register_forward_hook(functools.partial(leave, path), always_call=True))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = model(x)
    except Exception as error:
        raise RuntimeError(f"estimate_memory runs the model on torch.device('meta') tensors, which carry shapes "
                           f"and no data; its forward failed there ({type(error).__name__}: {error}). A forward that "
                           "reads values (.item(), data-dependent shapes) cannot be estimated") from error
    finally:
        for handle in handles:
            handle.remove()
    del output
    return saved


def _extents_at(base, extents, n):
    """Each tile coordinate's rows of a field of ``n`` rows derived from ``base`` rows dealt as ``extents``.

    Row ``o`` of the ``n``-row field belongs to the rank holding base row ``floor(o * base / n)``, as a
    converted stride-``s`` layer deals its outputs (and a transposed one ``s`` rows per input row);
    the last rank keeps every row past the others.
    """
    if n == base:
        return tuple(extents)
    found, start = [], 0
    for coord, extent in enumerate(extents):
        stop = start + extent
        lo = 0 if coord == 0 else min(n, -(-start * n // base))
        hi = n if coord == len(extents) - 1 else min(n, -(-stop * n // base))
        found.append(max(0, hi - lo))
        start = stop
    return tuple(found)


@dataclass(frozen=True)
class _Geometry:
    """How the converted model deals out the rows of one field: per sharded dim, (base rows, each coordinate's)."""

    dims: tuple

    def extents(self, axis, n):
        base, extents = self.dims[axis]
        return _extents_at(base, extents, n)


class _Layout:
    """The domain decomposition and the converted copy the recording is read against."""

    def __init__(self, domain_shape, dims, converted, input_sizes):
        self.domain_shape, self.dims = domain_shape, dims
        self.converted = dict(converted.named_modules())
        self.coords = list(itertools.product(*[range(p) for p in domain_shape]))
        self.input = _Geometry(tuple((n, balanced_split(n, p)[0]) for n, p in zip(input_sizes, domain_shape)))
        self._padded = {}

    def padding_of(self, path):
        """The DomainParallelTensorPadding of the converted module at ``path`` if it pads the field, else None."""
        module = self.converted.get(path)
        padding = getattr(module, "padding_opt", None)
        if isinstance(padding, DomainParallelTensorPadding) and getattr(module, "use_padding", False):
            return padding
        return None

    def padded(self, path, sizes):
        """The geometry inside the padded model at ``path`` whose input has ``sizes`` along the sharded dims."""
        key = (path, sizes)
        if key not in self._padded:
            padding = self.padding_of(path)
            pads = {-2: padding.pad_lat, -1: padding.pad_lon}
            found = []
            for axis, (d, parts, n) in enumerate(zip(self.dims, self.domain_shape, sizes)):
                before, after = pads.get(d, (0, 0))
                total = n + before + after
                if d == -2:
                    extents = padded_extents(total, parts, padding.align[0], padding.prefer)[0]
                    if extents is None:  # the converted model's own words
                        raise ValueError(f"estimate_memory: {path or '<model>'}: "
                                         f"{padding.layout_problem(balanced_split(n, parts)[0])}; the converted "
                                         "model would raise too")
                else:
                    own = balanced_split(n, parts)[0]
                    extents = tuple(e + (before if c == 0 else 0) + (after if c == parts - 1 else 0)
                                    for c, e in enumerate(own))
                found.append((total, tuple(extents)))
            self._padded[key] = _Geometry(tuple(found))
        return self._padded[key]

    def geometry(self, frames):
        """The geometry a tensor saved under ``frames`` (outermost first) belongs to."""
        for frame in reversed(frames):
            if frame.sizes is not None and self.padding_of(frame.path) is not None:
                return self.padded(frame.path, frame.sizes)
        return self.input


def _share(layout, geometry, sizes):
    """Each rank's fraction of a field with ``sizes`` along the sharded dims."""
    per_axis = [[e / n if n else 0.0 for e in geometry.extents(axis, n)] for axis, n in enumerate(sizes)]
    return [math.prod(per_axis[axis][c] for axis, c in enumerate(coords)) for coords in layout.coords]


def _conv_wrapper(layout, frames):
    """(wrapper, its frame) if the innermost frame is a convolution the converted copy wraps, else None."""
    inner = frames[-1]
    inner_module = layout.converted.get(inner.path)
    for frame in reversed(frames):
        wrapper = layout.converted.get(frame.path)
        if isinstance(wrapper, (_ForwardConv, _TransposedConv)):
            if frame is inner or wrapper.wrapped is inner_module:
                return wrapper, frame
            return None
        if frame is not inner:
            return None
    return None


def _conv_sizes(layout, geometry, wrapper, frame, inner, coords):
    """Sizes along the sharded dims of the storage ``wrapper`` keeps on the rank at ``coords``: its rows
    plus the halo it exchanges (or the window it narrows to, where a copy follows)."""
    conv = wrapper.wrapped
    spatial = len(conv.kernel_size)
    transposed = isinstance(wrapper, _TransposedConv)
    overrides = wrapper.padding_override
    if overrides is not None and len(layout.dims) == 1:
        overrides = (overrides,)
    own_padding = None if transposed else wrapper._own_padding()
    copies = isinstance(wrapper, DomainParallelPeriodicConv2d) or (not transposed and conv.padding_mode != "zeros")
    plans = []
    for axis_index, d in enumerate(layout.dims):
        axis = spatial + d
        override = overrides[axis_index] if overrides is not None and frame is inner else None
        n = frame.sizes[axis_index] - (sum(override) if override is not None else 0)
        extents = geometry.extents(axis_index, n)
        coord = coords[axis_index]
        k, s, dil = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
        if transposed:
            windows = rows.transposed_windows(extents, k, s, dil, conv.padding[axis], conv.output_padding[axis])
            window, halo = windows[coord], rows.halo_for(windows)
        else:
            before, after = override if override is not None else own_padding[axis]
            if s == 1:
                halo = rows.unit_stride_halo(k, dil, before, after)
                window = rows.unit_stride_window(extents[coord], coord == 0, coord == len(extents) - 1, k, dil,
                                                 before, after)
            else:
                windows = rows.conv_windows(extents, k, s, dil, before, after)
                window, halo = windows[coord], rows.halo_for(windows)
        plans.append((extents[coord], halo, window.in_stop - window.in_start))
    sizes = []
    for axis_index, (own, halo, window_rows) in enumerate(plans):
        copied_later = copies or any(h for _, h, _ in plans[axis_index + 1:])
        sizes.append(window_rows if copied_later else own + 2 * halo if halo else own)
    return sizes, any(h for _, h, _ in plans) or copies


def _saver(layout, batch, nbytes, shape, frames, is_input):
    """(key, each rank's bytes) of one save: the converted model keeps one storage per key."""
    geometry = layout.geometry(frames)
    for frame in reversed(frames):
        attention = layout.converted.get(frame.path)
        if isinstance(attention, DomainParallelWindowAttention) and frame.sizes is not None:
            per_axis, moved = [], False
            for axis_index, (n, parts) in enumerate(zip(frame.sizes, layout.domain_shape)):
                source = geometry.extents(axis_index, n)
                if parts == 1:
                    per_axis.append(source)
                    continue
                move = window_move(attention.kind, source, attention.window_size)
                moved = moved or move.source != move.target
                per_axis.append(move.target.extents)
            shares = [math.prod(per_axis[a][c] / n if n else 0.0 for a, (c, n) in enumerate(zip(coords, frame.sizes)))
                      for coords in layout.coords]
            return (("window", frame.path) if moved else ("rows",)), [nbytes * s for s in shares]
    found = _conv_wrapper(layout, frames)
    inner = frames[-1]
    if found is not None and inner.sizes is not None and is_input:
        wrapper, frame = found
        local = []
        exchanged = False
        for coords in layout.coords:
            sizes, exchanged = _conv_sizes(layout, geometry, wrapper, frame, inner, coords)
            local.append(nbytes * math.prod(s / n for s, n in zip(sizes, inner.sizes)))
        if exchanged:
            return ("conv", frame.path, id(inner)), local
    if len(shape) >= 3 and shape[0] == batch:
        sizes = tuple(shape[d] for d in layout.dims)
    else:
        sizes = next((f.sizes for f in reversed(frames) if f.sizes is not None), None)
    if sizes is None:
        return ("rows",), [nbytes] * len(layout.coords)
    return ("rows",), [nbytes * s for s in _share(layout, geometry, sizes)]


def _domain(manager_or_D):
    """(domain_shape, shard_dims) of an int D, a pair (D_lat, D_lon) or a manager."""
    if hasattr(manager_or_D, "domain_shape") and hasattr(manager_or_D, "shard_dims"):
        return tuple(manager_or_D.domain_shape), tuple(manager_or_D.shard_dims)
    if is_int(manager_or_D):
        if manager_or_D < 1:
            raise ValueError(f"manager_or_D must be >= 1 domain ranks, got {manager_or_D}")
        return domain_layout(int(manager_or_D), -2)
    if isinstance(manager_or_D, (tuple, list)) and len(manager_or_D) == 2 and all(is_int(d) for d in manager_or_D):
        return domain_layout(tuple(manager_or_D), (-2, -1))
    raise TypeError(f"manager_or_D must be an int D (latitude slabs), a pair (D_lat, D_lon) (tiles) or a "
                    f"DomainParallelManager, got {manager_or_D!r} ({type(manager_or_D).__name__})")


def _check_shape(input_shape, dims, domain_shape):
    if not isinstance(input_shape, (tuple, list, torch.Size)) or not all(is_int(n) for n in input_shape):
        raise TypeError(f"input_shape must be a tuple of ints such as (B, C, H, W), got {input_shape!r}")
    shape = tuple(int(n) for n in input_shape)
    if len(shape) < 3 or min(shape) < 1:
        raise ValueError(f"input_shape must be the global input's shape (B, C, ..., H, W) with every size >= 1, got "
                         f"{shape}")
    for d, parts in zip(dims, domain_shape):
        if -len(shape) > d or shape[d] < parts:
            raise ValueError(f"input_shape {shape} has {shape[d] if -len(shape) <= d else 'no'} rows along dim {d}, "
                             f"fewer than its {parts} ranks; use fewer ranks along it or a larger field")
    return shape


def _dtype_of(model, dtype):
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
        return dtype
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())


def _require_unconverted(model):
    """Raise ValueError if ``model`` holds domain-parallel layers: their forward would communicate."""
    layers = (Wrapper, HaloExchange, Redistribute, DomainParallelTensorPadding, DomainParallelInterpolate)
    for path, module in model.named_modules():
        held = [v for v in vars(module).values() if isinstance(v, DomainParallelTensorPadding)]
        if isinstance(module, layers) or held:
            raise ValueError(f"estimate_memory takes the unconverted model, but {path or '<model>'} is "
                             f"{type(held[0] if held else module).__name__}, a domain-parallel layer (its forward "
                             "communicates); pass the model as it was before convert_to_domain_parallel")


def _convert(copy_, dims, custom_converters, allow_local):
    """``copy_`` converted as the user converts the model, for the layout's ``dims``; checked against them."""
    shard_dim = dims if len(dims) > 1 else dims[0]
    if callable(custom_converters) and not isinstance(custom_converters, dict):
        custom_converters = custom_converters(shard_dim)
    converted = convert_to_domain_parallel(copy_, shard_dim=shard_dim, custom_converters=custom_converters,
                                           allow_local=allow_local)
    for path, module in converted.named_modules():
        found = getattr(module, "shard_dim", None)
        if isinstance(module, (_ForwardConv, _TransposedConv)) and shard_dims(found) != tuple(dims):
            raise ValueError(f"estimate_memory: custom_converters made {path} ({type(module).__name__}) shard "
                             f"dims {found}, but the layout shards {shard_dim}; build the converters for "
                             f"shard_dim={shard_dim}, or pass a callable shard_dim -> converters")
    return converted


def estimate_memory(model, input_shape, manager_or_D, *, custom_converters=None, allow_local=(), dtype=None):
    """Predict the activation bytes per rank one training forward of ``model``, converted, saves for backward.

    Local and before launch: one process, no MPI job of D ranks, no activations allocated (the
    model runs twice on the meta device, at batch B and 2B, to tell fields from tensors every rank
    keeps whole). ``model`` is the unconverted model (left unchanged); the estimate is for it converted
    by :func:`convert_to_domain_parallel` and run on ``shard_tensor``'s balanced shards in training
    mode, as :class:`SavedActivations` (parameters excluded) counts them.

    :param model: A ``torch.nn.Module`` (unconverted).
    :param input_shape: The global input's shape, ``(B, C, H, W)`` or the model's own (e.g. ``(B, C, T, H, W)``).
    :param manager_or_D: ``D`` (latitude slabs), ``(D_lat, D_lon)`` (tiles), or a manager (its layout).
    :param custom_converters: As :func:`convert_to_domain_parallel` takes them (the ones you convert with), or
        a callable ``shard_dim -> converters`` (``mpidomain.models.custom_converters``); factories get the
        meta copy's modules.
    :param allow_local: As :func:`convert_to_domain_parallel` takes it.
    :param dtype: The input's dtype; default the model's first floating parameter's.
    :returns: A :class:`MemoryEstimate` (``bytes_per_rank``: the largest rank's bytes).
    :raises ValueError: If the model cannot be converted or this layout cannot run (as the converted model
        would raise). :raises RuntimeError: If the model's forward cannot run on the meta device.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (unconverted), got {type(model).__name__}")
    _require_unconverted(model)
    domain_shape, dims = _domain(manager_or_D)
    shape = _check_shape(input_shape, dims, domain_shape)
    dtype = _dtype_of(model, dtype)
    converted = _convert(_meta_copy(model).train(), dims, custom_converters, allow_local)
    plain = _meta_copy(model).train()
    excluded = {_storage_key(p) for p in plain.parameters()}
    runs = []
    for batch in (shape[0], 2 * shape[0]):
        x = torch.empty((batch,) + shape[1:], dtype=dtype, device="meta")
        runs.append(_record(plain, x, dims, excluded))
    sizes = tuple(shape[d] for d in dims)
    layout = _Layout(domain_shape, dims, converted, sizes)
    once, twice = list(runs[0].values()), list(runs[1].values())
    if len(once) != len(twice):
        raise RuntimeError(f"estimate_memory: the model saved {len(once)} storages at batch {shape[0]} and "
                           f"{len(twice)} at batch {2 * shape[0]}, so it cannot tell fields (which grow with the "
                           "batch) from tensors every rank keeps whole")
    totals = [0.0] * len(layout.coords)
    for (nbytes, events), (nbytes_twice, _) in zip(once, twice):
        if nbytes_twice == nbytes:  # does not grow with the batch: whole on every rank
            totals = [t + nbytes for t in totals]
            continue
        kept = {}
        for event_shape, frames, is_input in events:
            key, local = _saver(layout, shape[0], nbytes, event_shape, frames, is_input)
            kept[key] = [max(a, b) for a, b in zip(kept.get(key, local), local)]
        for local in kept.values():
            totals = [t + b for t, b in zip(totals, local)]
    largest = max(range(len(totals)), key=lambda r: totals[r])
    coords = layout.coords[largest]
    tile = list(shape)
    for axis, d in enumerate(dims):
        tile[d] = layout.input.extents(axis, shape[d])[coords[axis]]
    return MemoryEstimate(input_shape=shape, domain_shape=domain_shape, tile_shape=tuple(tile),
                          bytes_per_rank=int(round(totals[largest])), largest_rank=largest,
                          rank_bytes=tuple(int(round(t)) for t in totals),
                          one_process_bytes=int(sum(nbytes for nbytes, _ in once)))


@dataclass(frozen=True)
class DrawEstimate:
    """What ``rng="one-process"`` draws on every rank in one training forward (:func:`estimate_draws`).

    ``calls``: the dropout calls with ``p > 0``; ``largest_bytes``: the largest whole-field mask (transient,
    freed once the rank's part is taken); ``total_bytes``: all their masks, the values each rank draws (with
    ``rng="tile"`` each rank draws its own share of them).
    """

    calls: int
    largest_bytes: int
    total_bytes: int


def estimate_draws(model, input_shape, dtype=None):
    """Predict what ``rng="one-process"`` draws per training forward of ``model`` on a global input of ``input_shape``.

    Local and before launch: the unconverted model runs once on the meta device; every ``nn.Dropout`` and
    ``nn.AlphaDropout`` with ``p > 0`` (CREDIT's attention-weight dropout included) counts its input, the
    mask one process draws. Returns a :class:`DrawEstimate`.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (unconverted), got {type(model).__name__}")
    _require_unconverted(model)
    plain = _meta_copy(model).train()
    sizes = []

    def count(module, args):
        x = _first_tensor(args)
        if x is not None:
            sizes.append(x.numel() * x.element_size())

    handles = [m.register_forward_pre_hook(count) for m in plain.modules()
               if type(m) in (torch.nn.Dropout, torch.nn.AlphaDropout) and m.p > 0]
    try:
        plain(torch.empty(tuple(input_shape), dtype=_dtype_of(model, dtype), device="meta"))
    except Exception as error:
        raise RuntimeError(f"estimate_draws runs the model on torch.device('meta') tensors; its forward failed there "
                           f"({type(error).__name__}: {error})") from error
    finally:
        for handle in handles:
            handle.remove()
    return DrawEstimate(len(sizes), max(sizes, default=0), sum(sizes))

"""Turn a single-process PyTorch model into a domain-parallel one, in place, or refuse.

Every module is decided, in this order (the first rule that applies):

1. ``allow_local`` (paths such as ``"encoder.1.attn"`` or module types): left as
   it is, children included: the user vouches that it is local;
2. ``custom_converters`` (``{type: factory}``, ``isinstance`` in dict order): the
   factory's result; its children are left as the factory made them;
3. blocks matched by their children (:data:`mpidomain.nn.blocks.BLOCK_CONVERTERS`:
   coordinate attention is replaced; :data:`~mpidomain.nn.blocks.CHILD_RULES`: an
   ECA block's ``Conv1d`` runs on a replicated mean, so it stays local), and
   CREDIT's modules recognised by what they have: window attention (``attn_type``
   "short"/"long", ``window_size``, ``to_qkv``, ``to_out``, ``rel_pos_indices``)
   becomes :class:`~mpidomain.nn.DomainParallelWindowAttention`; a channel
   ``LayerNorm`` (parameters ``g``, ``b`` of shape (1, C, 1, 1)) is local;
4. torch layers the library converts: ``Conv2d``/``Conv3d`` (unless each output
   row needs only its own input row: kernel 1, stride 1, no padding along the
   sharded dims), ``ConvTranspose2d``/``3d`` (unless kernel = stride without
   padding there), ``GroupNorm``, ``BatchNorm2d``/``3d``, ``Upsample``,
   ``MaxPool2d``, ``AvgPool2d``, ``AdaptiveAvgPool2d``, ``AdaptiveMaxPool2d``,
   ``PixelUnshuffle``; an ``nn.ZeroPad2d`` directly before an unpadded
   ``Conv2d`` in an ``nn.Sequential`` hands its sharded-dim padding to the
   wrapped convolution;
5. torch layers local along the sharded dims, left with the reason
   (:data:`LOCAL_REASONS`): pointwise activations, elementwise dropout,
   ``Identity``, pointwise convolutions, ``PixelShuffle``, channel operations,
   ``Linear``/``LayerNorm`` over the last dim (taken to be features:
   channels-last tokens or a pooled vector), padding of unsharded dims;
6. ``nn.Sequential``/``ModuleList``/``ModuleDict``: their children are decided;
7. any other module with children (a user block): its children are decided and
   it stays, reported as "its own forward is not seen": functional calls there
   (``F.interpolate``, ``F.avg_pool2d``, ``x.mean(-2)``) cannot be converted;
   use the module forms (``nn.Upsample``, ``nn.AvgPool2d``, ``nn.AdaptiveAvgPool2d``);
8. any other leaf module (no children: an unknown torch layer, a user layer, or
   a subclass of a torch layer with its own forward, whose forward the
   converter cannot see) is refused.

Before the modules, CREDIT's ``TensorPadding`` objects held as attributes
(``model.padding_opt``) become :class:`~mpidomain.nn.DomainParallelTensorPadding`
and a CrossFormer's final ``F.interpolate``, the identity, is switched off
(:mod:`mpidomain.nn.padded_models`).

Refused modules raise one ValueError naming every path and why. The decision
is local and deterministic (no communication): every rank converts the same
model, so every rank raises the same error. State dict keys do not change, so
a checkpoint of the model before conversion loads into the converted model and back.
"""

from dataclasses import dataclass

import torch

from .._validate import require_manager
from ..manager import get_domain_parallel_manager
from ._shard import Wrapper, shard_dims
from .blocks import BLOCK_CONVERTERS, CHILD_RULES
from .conv import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                   DomainParallelConvTranspose3d, conv_padding)
from .earth_padding import DomainParallelTensorPadding
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .norm import DomainParallelBatchNorm, DomainParallelGroupNorm
from .pool import (DomainParallelAdaptiveAvgPool2d, DomainParallelAdaptiveMaxPool2d, DomainParallelAvgPool2d,
                   DomainParallelMaxPool2d)
from .padded_models import channel_layer_norm_like, plan_padded_models
from .shuffle import DomainParallelPixelUnshuffle
from .window_attention import DomainParallelWindowAttention, window_attention_spec

__all__ = ["ConversionReport", "LOCAL_REASONS", "convert_to_domain_parallel"]

nn = torch.nn

_CONVS = {nn.Conv2d: DomainParallelConv2d, nn.Conv3d: DomainParallelConv3d}
_TRANSPOSED = {nn.ConvTranspose2d: DomainParallelConvTranspose2d, nn.ConvTranspose3d: DomainParallelConvTranspose3d}
_POOLS = {nn.MaxPool2d: DomainParallelMaxPool2d, nn.AvgPool2d: DomainParallelAvgPool2d,
          nn.AdaptiveAvgPool2d: DomainParallelAdaptiveAvgPool2d, nn.AdaptiveMaxPool2d: DomainParallelAdaptiveMaxPool2d}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
# Layers of this library: converted already (their children are theirs).
_CONVERTED = (Wrapper, DomainParallelInterpolate, HaloExchange, DomainParallelTensorPadding)

_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
                nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink,
                nn.Softshrink, nn.Tanhshrink, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Threshold)
_PADS = tuple(getattr(nn, f"{kind}Pad{n}d") for kind in ("Zero", "Constant", "Reflection", "Replication", "Circular")
              for n in (1, 2, 3) if hasattr(nn, f"{kind}Pad{n}d"))
_NORMS_OVER_LAST = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)

#: Why each kind of torch layer is local along the sharded dims (the report's wording).
LOCAL_REASONS = {
    "activation": "pointwise activation",
    "identity": "identity",
    "dropout": "elementwise dropout (each rank draws its own mask, as another seed would)",
    "pointwise conv": "pointwise along the sharded dims (kernel 1, stride 1, no padding there)",
    "transposed kernel = stride": "each input row makes its own stride output rows (kernel = stride, no padding)",
    "pixel shuffle": ("each input row makes r output rows: shard rows [a, b) become [r*a, r*b), as a transposed "
                      "convolution with kernel = stride = r gives"),
    "channels": "acts across channels only",
    "last dim": ("acts on the last dim only, taken to be features (channels-last tokens or a pooled vector); "
                 "on a (B, C, H, W) field sharded in longitude it would not be local"),
    "reshape": "reshapes only; the flattened dims are taken to be unsharded (e.g. after a global pool)",
    "lookup": "a lookup per index",
    "pad": "pads only dims that are not sharded",
    "softmax": "normalises along a dim that is not sharded",
    "forward unseen": ("its children are decided; its own forward is not seen: functional calls there "
                       "(F.interpolate, F.avg_pool2d, x.mean(-2)) are not converted"),
    "allowed": "allow_local",
    "channel norm": ("normalises each position over channels (CREDIT's channel LayerNorm: parameters g and b of "
                     "shape (1, C, 1, 1))"),
}


def window_attention_like(module):
    """True for a windowed attention module, such as CREDIT's CrossFormer ``Attention`` (see window_attention_spec)."""
    return window_attention_spec(module) is not None


def _window_attention(module, shard_dim, manager):
    return DomainParallelWindowAttention(module, manager=manager)


# CREDIT's modules the converter recognises by what they have: (matches, factory(module, shard_dim, manager)).
_RECOGNISED = ((window_attention_like, _window_attention),)


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_to_domain_parallel` did: ``converted`` (path, replacement) and ``local`` (path, why) pairs.

    Paths are those of ``model.named_modules()`` before conversion (``""`` is the model itself).
    """

    converted: tuple
    local: tuple

    def __str__(self):
        lines = [f"converted ({len(self.converted)}):"]
        lines += [f"  {path or '<model>'}: {what}" for path, what in self.converted]
        lines.append(f"left local ({len(self.local)}):")
        lines += [f"  {path or '<model>'}: {why}" for path, why in self.local]
        return "\n".join(lines)


def _axis(module, shard_dim):
    """The index of ``shard_dim`` among the module's spatial dims (inputs are (B, C, *spatial))."""
    spatial = len(module.kernel_size)
    axis = shard_dim + spatial if shard_dim < 0 else shard_dim - 2
    if not 0 <= axis < spatial:
        raise ValueError(f"shard_dim={shard_dim} is not a spatial dim of {type(module).__name__}'s "
                         f"(B, C, {spatial} spatial dims) inputs; pass a negative spatial dim such as -2")
    return axis


def _local_conv(conv, axis):
    return conv.kernel_size[axis] == 1 and conv.stride[axis] == 1 and conv_padding(conv)[axis] == (0, 0)


def _local_transposed(conv, axis):
    k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
    return d * (k - 1) + 1 == s and conv.padding[axis] == 0 and conv.output_padding[axis] == 0


def _local_along(local, module, shard_dim):
    """True if ``local(module, axis)`` holds along every sharded dim."""
    return all(local(module, _axis(module, d)) for d in shard_dims(shard_dim))


def _pad_local(pad, shard_dim):
    """True if padding module ``pad`` (F.pad order: last dim first) pads no sharded dim."""
    widths = tuple(pad.padding) if isinstance(pad.padding, (tuple, list)) else (pad.padding,) * (2 * _pad_dims(pad))
    for d in shard_dims(shard_dim):
        index = 2 * (-d - 1)
        if index + 1 < len(widths) and (widths[index] or widths[index + 1]):
            return False
    return True


def _pad_dims(pad):
    name = type(pad).__name__
    return int(name[-2]) if name[-2].isdigit() else 2


def _softmax_local(dim, shard_dim):
    if dim is None:
        return False
    return dim in (0, 1) or (dim < 0 and dim not in shard_dims(shard_dim))


def _torch_base(module):
    """The first class in ``module``'s MRO that torch.nn defines (``nn.Module`` for a user module)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.modules"):
            return cls
    return nn.Module


def _decide(module, shard_dim, manager):
    """Return ("convert", replacement), ("local", reason), ("refuse", reason) or ("visit", reason or None)."""
    base = _torch_base(module)
    if base is not nn.Module and getattr(type(module), "forward") is not getattr(base, "forward"):
        # A subclass of a torch layer with its own forward: the torch layer's rule says nothing about it.
        if any(child is not None for child in module._modules.values()):
            return "visit", LOCAL_REASONS["forward unseen"]
        return "refuse", (f"a subclass of torch.nn.{base.__name__} with its own forward, which the converter cannot "
                          f"see (the rule for {base.__name__} does not apply)")
    for base, wrapper in _CONVS.items():
        if isinstance(module, base):
            if _local_along(_local_conv, module, shard_dim):
                return "local", LOCAL_REASONS["pointwise conv"]
            return "convert", wrapper(module, shard_dim, manager)
    for base, wrapper in _TRANSPOSED.items():
        if isinstance(module, base):
            if _local_along(_local_transposed, module, shard_dim):
                return "local", LOCAL_REASONS["transposed kernel = stride"]
            return "convert", wrapper(module, shard_dim, manager)
    if isinstance(module, nn.Conv1d):
        if module.kernel_size == (1,) and module.stride == (1,) and conv_padding(module) == [(0, 0)]:
            return "local", LOCAL_REASONS["pointwise conv"]
        return "refuse", ("a Conv1d with kernel > 1 convolves the last dim of a reshaped tensor; the converter cannot "
                          "tell whether that dim holds sharded positions")
    if isinstance(module, nn.ConvTranspose1d):
        if _local_transposed(module, 0):
            return "local", LOCAL_REASONS["transposed kernel = stride"]
        return "refuse", "a ConvTranspose1d mixes neighbouring positions of a reshaped tensor's last dim"
    if isinstance(module, nn.GroupNorm):
        return "convert", DomainParallelGroupNorm(module, shard_dim, manager)
    if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm3d)) and not isinstance(module, nn.SyncBatchNorm):
        return "convert", DomainParallelBatchNorm(module, shard_dim, manager)
    if isinstance(module, nn.Upsample):
        return "convert", DomainParallelInterpolate.from_upsample(module, shard_dim, manager)
    for base, wrapper in _POOLS.items():
        if type(module) is base:
            if getattr(module, "return_indices", False):
                return "refuse", "return_indices=True: the indices would be local to each shard"
            return "convert", wrapper(module, shard_dim, manager)
    if type(module) is nn.PixelUnshuffle:
        return "convert", DomainParallelPixelUnshuffle(module, shard_dim, manager)
    if type(module) is nn.PixelShuffle:
        return "local", LOCAL_REASONS["pixel shuffle"]
    if isinstance(module, _ACTIVATIONS):
        return "local", LOCAL_REASONS["activation"]
    if type(module) is nn.Identity:
        return "local", LOCAL_REASONS["identity"]
    if type(module) in (nn.Dropout, nn.AlphaDropout):
        return "local", LOCAL_REASONS["dropout"]
    if isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout)):
        if module.p == 0:
            return "local", LOCAL_REASONS["identity"]
        return "refuse", ("drops whole channels of the field: each rank would draw its own channel mask, so a channel "
                          "would be dropped on some shards only")
    if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.GLU)):
        if _softmax_local(module.dim, shard_dim):
            return "local", LOCAL_REASONS["softmax"]
        return "refuse", f"works along dim={module.dim}, which may be a sharded dim of the field"
    if isinstance(module, (nn.Softmax2d, nn.LocalResponseNorm, nn.ChannelShuffle)):
        return "local", LOCAL_REASONS["channels"]
    if isinstance(module, (nn.Linear, nn.Bilinear)):
        return "local", LOCAL_REASONS["last dim"]
    if isinstance(module, _NORMS_OVER_LAST):
        if len(_normalized_shape(module)) == 1:
            return "local", LOCAL_REASONS["last dim"]
        return "refuse", (f"normalises over its last {len(_normalized_shape(module))} dims, which on a field include "
                          "sharded dims")
    if isinstance(module, (nn.Flatten, nn.Unflatten)):
        return "local", LOCAL_REASONS["reshape"]
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "local", LOCAL_REASONS["lookup"]
    if isinstance(module, _PADS):
        if _pad_local(module, shard_dim):
            return "local", LOCAL_REASONS["pad"]
        return "refuse", ("pads a sharded dim, so each shard would be padded at its own edges; use the convolution's "
                          "padding, or an nn.ZeroPad2d directly before an unpadded Conv2d in an nn.Sequential")
    if isinstance(module, (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
                           nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)):
        return "refuse", "attends or recurs over a sequence, which may hold sharded positions"
    if isinstance(module, _CONTAINERS):
        return "visit", None
    if any(child is not None for child in module._modules.values()):
        return "visit", LOCAL_REASONS["forward unseen"]
    return "refuse", ("not known to be local along the sharded dims (the converter decides each layer by its type "
                      "and cannot see what a forward does)")


def _normalized_shape(norm):
    shape = norm.normalized_shape
    return tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)


def _pad_before_conv(sequential, index, shard_dim, manager):
    """For ``ZeroPad2d`` at ``index`` followed by an unpadded ``Conv2d``: the (pad, conv) replacements, or None."""
    pad, conv = sequential[index], sequential[index + 1]
    if not (type(pad) is nn.ZeroPad2d and isinstance(conv, nn.Conv2d)
            and conv_padding(conv) == [(0, 0), (0, 0)]):
        return None
    left, right, top, bottom = pad.padding
    along = [(top, bottom) if _axis(conv, d) == 0 else (left, right) for d in shard_dims(shard_dim)]
    axes = {_axis(conv, d) for d in shard_dims(shard_dim)}
    kept = nn.ZeroPad2d((0 if 1 in axes else left, 0 if 1 in axes else right,
                         0 if 0 in axes else top, 0 if 0 in axes else bottom))
    padding = along[0] if len(along) == 1 else tuple(along)
    return kept, DomainParallelConv2d(conv, shard_dim, manager, padding=padding)


class _Walk:
    """One conversion: the decisions, the replacements to install, the report and the refusals."""

    def __init__(self, shard_dim, manager, converters, allowed_paths, allowed_types):
        self.shard_dim, self.manager, self.converters = shard_dim, manager, converters
        self.allowed_paths, self.allowed_types = allowed_paths, allowed_types
        self.converted, self.local, self.refused, self.installs = [], [], [], []
        self.seen_paths = set()

    def module(self, module, path, overrides=None):
        """Decide ``module`` at ``path``; return its replacement or None (it stays)."""
        self.seen_paths.add(path)
        if path in self.allowed_paths or isinstance(module, self.allowed_types):
            self.local.append((path, LOCAL_REASONS["allowed"]))
            return None
        for base, factory in self.converters.items():
            if isinstance(module, base):
                replacement = factory(module)
                self.converted.append((path, f"{type(module).__name__} -> {type(replacement).__name__} "
                                             "(custom_converters)"))
                return replacement
        if isinstance(module, _CONVERTED):
            self.local.append((path, f"{type(module).__name__}: domain-parallel already"))
            return None
        if overrides and path.rpartition(".")[2] in overrides:
            self.local.append((path, overrides[path.rpartition(".")[2]]))
            return None
        for matches, factory in BLOCK_CONVERTERS + _RECOGNISED:
            if matches(module):
                replacement = factory(module, self.shard_dim, self.manager)
                self.converted.append((path, f"{type(module).__name__} -> {type(replacement).__name__} "
                                             f"(matched by {matches.__name__})"))
                return replacement
        if channel_layer_norm_like(module) and type(module).__name__ == "LayerNorm":
            self.local.append((path, f"{type(module).__name__}: {LOCAL_REASONS['channel norm']}"))
            return None
        kind, what = _decide(module, self.shard_dim, self.manager)
        if kind == "convert":
            self.converted.append((path, f"{type(module).__name__} -> {type(what).__name__}"))
            return what
        if kind == "local":
            self.local.append((path, f"{type(module).__name__}: {what}"))
            return None
        if kind == "refuse":
            self.refused.append((path, f"{type(module).__name__}: {what}"))
            return None
        if what is not None:
            self.local.append((path, f"{type(module).__name__}: {what}"))
        self.children(module, path)
        return None

    def children(self, parent, path):
        overrides = {}
        for rule in CHILD_RULES:
            overrides.update(rule(parent) or {})
        names = [name for name, child in parent._modules.items() if child is not None]
        prefix = f"{path}." if path else ""
        index = 0
        while index < len(names):
            name = names[index]
            if isinstance(parent, nn.Sequential) and index + 1 < len(names) and \
                    f"{prefix}{name}" not in self.allowed_paths:
                pair = _pad_before_conv(parent, index, self.shard_dim, self.manager)
                if pair is not None:
                    following = names[index + 1]
                    self.installs += [(parent, name, pair[0]), (parent, following, pair[1])]
                    self.seen_paths.update((f"{prefix}{name}", f"{prefix}{following}"))
                    self.local.append((f"{prefix}{name}", f"ZeroPad2d: {LOCAL_REASONS['pad']} (its sharded-dim "
                                                          f"padding moved into {prefix}{following})"))
                    self.converted.append((f"{prefix}{following}", "Conv2d -> DomainParallelConv2d (with the "
                                                                   "ZeroPad2d's padding)"))
                    index += 2
                    continue
            replacement = self.module(parent._modules[name], f"{prefix}{name}", overrides)
            if replacement is not None:
                self.installs.append((parent, name, replacement))
            index += 1


def convert_to_domain_parallel(model, manager=None, shard_dim=None, custom_converters=None, *, allow_local=(),
                               report=False):
    """Replace ``model``'s layers that need other ranks' rows by domain-parallel ones; return ``model``.

    Local and deterministic (no communication): every rank converts the same
    model and takes the same decisions, so a refusal raises the same
    ValueError on every rank. The converted model's forward and backward are
    collective over the domain group. The rules are the module docstring's.

    :param model: A ``torch.nn.Module``, changed in place (a bare convertible layer is returned converted).
    :param manager: The manager the layers use; default: the global one when they run.
    :param shard_dim: The sharded dim of the layers' inputs (-2: latitude of (B, C, H, W) and (B, C, T, H, W)),
        or the pair ``(-2, -1)`` for tiles. Default: the manager's ``shard_dim`` (``manager``, else the
        global one if initialised, else -2).
    :param custom_converters: ``{type: factory}``, ``factory(module) -> replacement``, tried first
        (after ``allow_local``), matched with ``isinstance`` in order.
    :param allow_local: Module paths (as ``model.named_modules()`` names them, e.g. ``"blocks.0.norm"``) or
        module types to leave as they are, children included, for modules the converter would refuse
        but you know to be local along the sharded dims.
    :param report: If True, return ``(model, ConversionReport)``: every converted path with its
        replacement, every path left local with why.
    :raises ValueError: Naming every module the converter cannot make exact (its path, type and why),
        before anything is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if manager is not None:
        require_manager(manager, "convert_to_domain_parallel")
    if shard_dim is None:
        found = manager if manager is not None else get_domain_parallel_manager()
        shard_dim = -2 if found is None else found.shard_dim
    dims = shard_dims(shard_dim)
    if not (0 < len(dims) <= 2 and all(isinstance(d, int) and not isinstance(d, bool) and d < 0 for d in dims)
            and list(dims) == sorted(set(dims))):
        raise ValueError(f"shard_dim must be a negative int counted from the last dim (e.g. -2), or a pair such as "
                         f"(-2, -1) for tiles, got {shard_dim!r}")
    converters = dict(custom_converters or {})
    for key in converters:
        if not isinstance(key, type):
            raise TypeError(f"custom_converters keys must be module types, got {key!r}")
    if isinstance(allow_local, (str, type)):
        allow_local = (allow_local,)
    paths, types = set(), []
    for entry in allow_local:
        if isinstance(entry, str):
            paths.add(entry)
        elif isinstance(entry, type):
            types.append(entry)
        else:
            raise TypeError(f"allow_local entries must be module paths (str) or module types, got {entry!r}")
    padded = plan_padded_models(model, manager)  # raises before anything changes
    walk = _Walk(shard_dim, manager, converters, paths, tuple(types))
    root = walk.module(model, "")
    unknown = sorted(paths - {name for name, _ in model.named_modules()})
    if unknown:
        raise ValueError(f"allow_local names {unknown}, which are not module paths of the model (paths are "
                         f"model.named_modules() names, e.g. {[n for n, _ in model.named_modules()][1:4]})")
    if walk.refused:
        listing = "\n".join(f"  {path or '<model>'} ({why})" for path, why in walk.refused)
        raise ValueError(
            f"convert_to_domain_parallel cannot make {len(walk.refused)} module(s) exact on shards, and leaves "
            f"nothing local silently:\n{listing}\nConvert them yourself (custom_converters={{type: factory}}), use "
            "a module form the converter knows, or, if a module is local along the sharded dims in your model, "
            "pass its path or type in allow_local=(...)"
        )
    for parent, name, replacement in walk.installs:
        parent._modules[name] = replacement
    for module, name, value, path, what in padded:
        setattr(module, name, value)
        walk.converted.append((path, what))
    result = model if root is None else root
    if report:
        return result, ConversionReport(tuple(walk.converted), tuple(walk.local))
    return result

"""Turn a single-process PyTorch model into a domain-parallel one, in place.

CREDIT's rules (``credit.domain_parallel.convert``), made exact:

- custom converters first (``{type: factory}``, matched with ``isinstance`` in
  dict order); a converted module's children are left as the factory made them;
- ``Conv2d``/``Conv3d`` are wrapped unless each output row needs only its own
  input row (kernel 1, stride 1 and no padding along the sharded dim: CREDIT's
  1x1 and 1xN convolutions). Unlike CREDIT, a 1x1 convolution with stride 2
  there is wrapped: on a shard starting at an odd row it would pick other rows;
- ``ConvTranspose2d``/``3d`` are wrapped unless each input row makes exactly its
  own ``stride`` output rows (kernel == stride, no padding there: e.g. kernel 2,
  stride 2); CREDIT leaves every kernel <= stride alone, which for kernel < stride
  leaves rows out;
- ``GroupNorm`` becomes :class:`DomainParallelGroupNorm`, ``Upsample`` becomes
  :class:`DomainParallelInterpolate`; ``LayerNorm``, pointwise layers and
  everything else are local and stay;
- a CREDIT ``TensorPadding`` held as an attribute becomes a
  :class:`DomainParallelTensorPadding` (:mod:`mpidomain.nn.padded_models`), and a
  CrossFormer's final ``F.interpolate``, the identity, is switched off;
- an ``nn.ZeroPad2d`` directly before an unpadded ``Conv2d`` in an
  ``nn.Sequential`` (CREDIT's CrossEmbed branch) keeps its longitude padding;
  its latitude padding becomes the wrapped convolution's.

State dict keys do not change, so a checkpoint of the model before
conversion loads into the converted model and back.
"""

import torch

from .._validate import require_manager
from ..manager import get_domain_parallel_manager
from ._shard import Wrapper, shard_dims
from .earth_padding import DomainParallelTensorPadding
from .padded_models import convert_padded_models
from .conv import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                   DomainParallelConvTranspose3d, conv_padding)
from .interpolate import DomainParallelInterpolate
from .norm import DomainParallelGroupNorm

__all__ = ["convert_to_domain_parallel"]

_CONVS = {torch.nn.Conv2d: DomainParallelConv2d, torch.nn.Conv3d: DomainParallelConv3d}
_TRANSPOSED = {torch.nn.ConvTranspose2d: DomainParallelConvTranspose2d,
               torch.nn.ConvTranspose3d: DomainParallelConvTranspose3d}


def _axis(module, shard_dim):
    """The index of ``shard_dim`` among the module's spatial dims (inputs are (B, C, *spatial))."""
    spatial = len(module.kernel_size)
    axis = shard_dim + spatial if shard_dim < 0 else shard_dim - 2
    if not 0 <= axis < spatial:
        raise ValueError(f"shard_dim={shard_dim} is not a spatial dim of {type(module).__name__}'s "
                         f"(B, C, {spatial} spatial dims) inputs; pass a negative spatial dim such as -2")
    return axis


def _local_conv(conv, axis):
    return (conv.kernel_size[axis] == 1 and conv.stride[axis] == 1 and conv_padding(conv)[axis] == (0, 0))


def _local_transposed(conv, axis):
    k, s, d = conv.kernel_size[axis], conv.stride[axis], conv.dilation[axis]
    return d * (k - 1) + 1 == s and conv.padding[axis] == 0 and conv.output_padding[axis] == 0


def _local_along(local, module, shard_dim):
    """True if ``local(module, axis)`` holds along every sharded dim."""
    return all(local(module, _axis(module, d)) for d in shard_dims(shard_dim))


def _builtin(module, shard_dim, manager):
    """Return the domain-parallel replacement of ``module``, or None to leave it (and visit its children)."""
    for base, wrapper in _CONVS.items():
        if isinstance(module, base):
            return None if _local_along(_local_conv, module, shard_dim) else wrapper(module, shard_dim, manager)
    for base, wrapper in _TRANSPOSED.items():
        if isinstance(module, base):
            return None if _local_along(_local_transposed, module, shard_dim) else wrapper(module, shard_dim, manager)
    if isinstance(module, torch.nn.GroupNorm):
        return DomainParallelGroupNorm(module, shard_dim, manager)
    if isinstance(module, torch.nn.Upsample):
        return DomainParallelInterpolate.from_upsample(module, shard_dim, manager)
    return None


def _pad_before_conv(sequential, index, shard_dim, manager):
    """For ``ZeroPad2d`` at ``index`` followed by an unpadded ``Conv2d``: the (pad, conv) replacements, or None."""
    pad, conv = sequential[index], sequential[index + 1]
    if not (type(pad) is torch.nn.ZeroPad2d and isinstance(conv, torch.nn.Conv2d)
            and conv_padding(conv) == [(0, 0), (0, 0)]):
        return None
    left, right, top, bottom = pad.padding
    along = [(top, bottom) if _axis(conv, d) == 0 else (left, right) for d in shard_dims(shard_dim)]
    axes = {_axis(conv, d) for d in shard_dims(shard_dim)}
    kept = torch.nn.ZeroPad2d((0 if 1 in axes else left, 0 if 1 in axes else right,
                               0 if 0 in axes else top, 0 if 0 in axes else bottom))
    padding = along[0] if len(along) == 1 else tuple(along)
    return kept, DomainParallelConv2d(conv, shard_dim, manager, padding=padding)


def convert_to_domain_parallel(model, manager=None, shard_dim=None, custom_converters=None):
    """Replace ``model``'s layers that need other ranks' rows by domain-parallel ones; return ``model``.

    Local (no communication); the converted model's forward and backward are
    collective over the domain group. Every rank converts the same model.
    The rules are the module docstring's; ``custom_converters`` maps a module
    type to ``factory(module) -> replacement`` and is tried first.

    :param model: A ``torch.nn.Module``, changed in place (a bare convertible layer is returned converted).
    :param manager: The manager the layers use; default: the global one when they run.
    :param shard_dim: The sharded dim of the layers' inputs (-2: latitude of (B, C, H, W) and (B, C, T, H, W)),
        or the pair ``(-2, -1)`` for tiles. Default: the manager's ``shard_dim`` (``manager``, else the
        global one if initialised, else -2).
    :param custom_converters: ``{type: factory}``, matched with ``isinstance`` in order.
    """
    if not isinstance(model, torch.nn.Module):
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

    def convert(module):
        for base, factory in converters.items():
            if isinstance(module, base):
                return factory(module)
        return _builtin(module, shard_dim, manager)

    root = convert(model)
    if root is not None:
        return root
    convert_padded_models(model, manager)
    _convert_children(model, convert, shard_dim, manager)
    return model


def _convert_children(parent, convert, shard_dim, manager):
    names = list(parent._modules)
    index = 0
    while index < len(names):
        name = names[index]
        child = parent._modules[name]
        if child is None:
            index += 1
            continue
        if isinstance(parent, torch.nn.Sequential) and index + 1 < len(names):
            pair = _pad_before_conv(parent, index, shard_dim, manager)
            if pair is not None:
                parent._modules[name], parent._modules[names[index + 1]] = pair
                index += 2
                continue
        if isinstance(child, (Wrapper, DomainParallelInterpolate, DomainParallelTensorPadding)):  # converted already
            index += 1
            continue
        replacement = convert(child)
        if replacement is not None:
            parent._modules[name] = replacement
        else:
            _convert_children(child, convert, shard_dim, manager)
        index += 1

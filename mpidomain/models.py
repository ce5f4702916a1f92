"""Built-in models for the demo, the forecast command and the benchmarks; CREDIT's CrossFormer where installed.

:class:`UNet` is a small U-Net on latitude x longitude fields whose convolutions
wrap around in longitude (:class:`PeriodicConv`); :func:`convert_model` makes
any of these models domain-parallel. :func:`credit_crossformer` builds CREDIT's
CrossFormer (``miles-credit``) in a configuration that maps ``(B, C, H, W)``
fields to fields of the same shape, so forecasts can roll out.
"""

import importlib
import sys
import types

import torch
import torch.nn.functional as F

from .layout.tiles import balanced_split
from .nn import Decision, DomainParallelPeriodicConv2d, Rule, convert_to_domain_parallel

__all__ = ["PeriodicConv", "UNet", "FieldCrossFormer", "RULES", "convert_model", "custom_converters",
           "credit_crossformer", "credit_missing", "unet_grid_problem", "CREDIT_INSTALL"]

#: The line that installs what CREDIT's CrossFormer needs here (its own requirements pull a CUDA torchvision).
CREDIT_INSTALL = "pip install einops && pip install --no-deps miles-credit==2026.2.0"


class PeriodicConv(torch.nn.Module):
    """A 3x3 convolution padded circularly in longitude and with zeros in latitude."""

    def __init__(self, channels_in, channels_out):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels_in, channels_out, 3, padding=(1, 0))

    def forward(self, x):
        return self.conv(F.pad(x, (1, 1, 0, 0), mode="circular"))


class UNet(torch.nn.Module):
    """A small U-Net: periodic 3x3 convolutions, GroupNorm, a stride-2 level down and a transposed one up.

    Maps ``(B, channels, H, W)`` to the same shape (a residual step); H and W must be even.
    """

    def __init__(self, channels=2, width=16):
        super().__init__()
        self.encode = PeriodicConv(channels, width)
        self.norm = torch.nn.GroupNorm(4, width)
        self.down = torch.nn.Conv2d(width, 2 * width, 4, stride=2, padding=1)
        self.norm_down = torch.nn.GroupNorm(4, 2 * width)
        self.middle = PeriodicConv(2 * width, 2 * width)
        self.up = torch.nn.ConvTranspose2d(2 * width, width, 4, stride=2, padding=1)
        self.decode = torch.nn.Conv2d(2 * width, channels, 1)

    def forward(self, x):
        skip = F.silu(self.norm(self.encode(x)))
        deep = F.silu(self.middle(F.silu(self.norm_down(self.down(skip)))))
        return x + self.decode(torch.cat([skip, self.up(deep)], dim=1))


def unet_grid_problem(height, width, tiles):
    """Return why :class:`UNet` cannot run on ``height`` x ``width`` cut into ``tiles`` ``(D_lat, D_lon)`` (as
    :func:`mpidomain.balanced_split` cuts), or None. It halves the field once: every tile needs an even number of
    rows and of columns, at least 4."""
    rows, columns = (balanced_split(n, parts)[0] for n, parts in zip((height, width), tiles))
    if all(n % 2 == 0 and n >= 4 for n in (*rows, *columns)):
        return None
    return (f"the U-Net halves the field once, so each tile needs an even number of rows and columns, at least 4, "
            f"but the tiles would have {'/'.join(map(str, sorted(set(rows))))} rows and "
            f"{'/'.join(map(str, sorted(set(columns))))} columns; use a grid that {2 * tiles[0]} x {2 * tiles[1]} "
            f"divides, e.g. {max(4, 2 * tiles[0]) * 8}x{max(4, 2 * tiles[1]) * 16}")


class FieldCrossFormer(torch.nn.Module):
    """CREDIT's CrossFormer on ``(B, C, H, W)`` fields: one input frame in, one frame out, same shape."""

    def __init__(self, crossformer):
        super().__init__()
        self.crossformer = crossformer

    def forward(self, x):
        return self.crossformer(x.unsqueeze(2)).squeeze(2)


def _periodic_conv(module, shard_dim, manager):
    """The domain-parallel :class:`PeriodicConv`: its parameters, the longitude wrap through the halos."""
    inner = module.conv
    conv = torch.nn.Conv2d(inner.in_channels, inner.out_channels, inner.kernel_size, padding=1)
    conv.weight, conv.bias = inner.weight, inner.bias
    return DomainParallelPeriodicConv2d(conv, shard_dim, manager)


#: The converter rules :func:`convert_model` adds: :class:`PeriodicConv` becomes a ``DomainParallelPeriodicConv2d``.
RULES = (
    Rule("PeriodicConv", PeriodicConv,
         lambda module, context: Decision.convert(_periodic_conv(module, context.shard_dim, context.manager),
                                                  "mpidomain.models.RULES"),
         outcomes=(("convert", "", "`DomainParallelPeriodicConv2d`: the longitude wrap through the halos"),)),
)


def custom_converters(shard_dim=-2, manager=None):
    """Return :data:`RULES` as ``custom_converters`` (``{type: factory}``) for ``shard_dim`` and ``manager``.

    For :func:`mpidomain.nn.estimate_memory` before launch (no manager yet): ``shard_dim`` -2 for
    latitude slabs, ``(-2, -1)`` for tiles. Local.
    """
    return {PeriodicConv: lambda m: _periodic_conv(m, shard_dim, manager)}


def convert_model(model, manager, rng="tile"):
    """Return ``model`` (a :class:`UNet`, a :class:`FieldCrossFormer` or any convertible model) domain-parallel.

    Converts in place, as :func:`mpidomain.nn.convert_to_domain_parallel` does, with :data:`RULES` (the rule
    for :class:`PeriodicConv`) and its random layers drawing as ``rng`` says. Local: every rank converts its own
    copy alike; the state dict keys do not change.
    """
    return convert_to_domain_parallel(model, manager=manager, rules=RULES, rng=rng)


def _post_block_placeholder(error):
    module = types.ModuleType("credit.postblock.gen1")

    class PostBlock:
        def __init__(self, *args, **kwargs):
            raise ImportError(f"CREDIT's PostBlock needs torchvision, which failed to import here: {error}")

    module.PostBlock = PostBlock
    return module


def credit_crossformer_module():
    """Return ``credit.models.wxformer.crossformer``; ImportError if CREDIT (``miles-credit``) or einops is missing.

    CrossFormer's module imports CREDIT's optional post-processing block, which reaches torchvision; PyPI's
    torchvision wheels cannot load beside a CPU torch. Where that import fails, a ``PostBlock`` that raises the
    original error stands in for it: CrossFormer builds one only when ``post_conf["activate"]`` is set.
    """
    importlib.import_module("credit")
    if "credit.postblock.gen1" not in sys.modules:
        try:
            importlib.import_module("credit.postblock.gen1")
        except (ImportError, RuntimeError) as error:  # RuntimeError: a CUDA torchvision beside CPU torch
            sys.modules["credit.postblock.gen1"] = _post_block_placeholder(error)
    return importlib.import_module("credit.models.wxformer.crossformer")


def credit_missing():
    """Return None if CREDIT's CrossFormer imports here, else the reason and :data:`CREDIT_INSTALL` in one line."""
    try:
        credit_crossformer_module()
    except Exception as error:  # ImportError, or torchvision's RuntimeError on a CUDA wheel beside CPU torch
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}; {CREDIT_INSTALL}"
    return None


def credit_crossformer(channels, levels, surface_channels, height, width, *, dim=(8, 16, 32, 64), depth=(1, 1, 1, 1),
                       dim_head=4, local_window_size=2, global_window_size=(4, 2, 2, 1), padding_conf=None):
    """Return a slim CREDIT CrossFormer as a :class:`FieldCrossFormer`: ``channels`` variables at ``levels`` levels
    plus ``surface_channels`` surface variables in and out, one frame, spectral norm.

    Four stages of stride 2 with the given windows: each latitude rank needs whole groups of
    16 x max(local window, global windows) rows (32 with the defaults), and so does each longitude rank.
    ``padding_conf``: CREDIT's padding (e.g. ``dict(activate=True, mode="earth", pad_lat=[37, 38],
    pad_lon=[76, 76])`` at 1 degree); default none: H and W must then split into those groups unpadded.
    Raises ImportError (with the install line) where CREDIT is not installed.
    """
    try:
        module = credit_crossformer_module()
    except ImportError as error:
        raise ImportError(f"CREDIT's CrossFormer needs miles-credit and einops: {CREDIT_INSTALL} ({error})") from error
    model = module.CrossFormer(
        image_height=height, image_width=width, frames=1, channels=channels, levels=levels,
        surface_channels=surface_channels, input_only_channels=0, output_only_channels=0, dim=tuple(dim),
        depth=tuple(depth), dim_head=dim_head, local_window_size=local_window_size,
        global_window_size=tuple(global_window_size), cross_embed_kernel_sizes=((4, 8), (2, 4), (2, 4), (2, 4)),
        cross_embed_strides=(2, 2, 2, 2), use_spectral_norm=True, padding_conf=padding_conf)
    return FieldCrossFormer(model)

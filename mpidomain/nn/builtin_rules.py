"""The converter's built-in rules, in order: :data:`BUILTIN_RULES` (tried after ``allow_local`` and your rules).

Each :class:`~mpidomain.nn.rule.Rule` matches by type or by what a module
holds and decides convert, local (with why), refuse (with why) or visit.
:func:`rules_table` lists them as markdown (``docs/converter-rules.md`` is its
output, checked by the tests). Local and deterministic: no communication.
"""

import torch

from ._shard import Wrapper, shard_dims
from .blocks import BLOCK_CONVERTERS, CHILD_RULES
from .dropout import DomainParallelDropout, DomainParallelRReLU
from .conv import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                   DomainParallelConvTranspose3d, conv_padding)
from .earth_padding import DomainParallelTensorPadding
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .norm import DomainParallelBatchNorm, DomainParallelGroupNorm
from .padded_models import channel_layer_norm_like
from .pool import (DomainParallelAdaptiveAvgPool2d, DomainParallelAdaptiveMaxPool2d, DomainParallelAvgPool2d,
                   DomainParallelMaxPool2d)
from .rule import Decision, Rule, markdown_table
from .shuffle import DomainParallelPixelUnshuffle
from .window_attention import DomainParallelWindowAttention, window_attention_spec

__all__ = ["BUILTIN_RULES", "LOCAL_REASONS", "CHILD_RULES", "allow_local_rule", "axis_of", "child_reasons",
           "rules_table", "table_rules", "window_attention_like"]

nn = torch.nn

#: Why each kind of torch layer is local along the sharded dims (the report's wording).
LOCAL_REASONS = {
    "activation": "pointwise activation",
    "identity": "identity",
    "drop path": ("draws one value per sample (a (B, 1, ...) mask) from torch's default generator, which advances "
                  "alike on every rank of a domain group: the same on every shard, as one process draws it"),
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

# Why modules are refused (the error's wording, after "path (Type: ").
_REFUSALS = {
    "subclass": "a subclass of torch.nn.{base} with its own forward, which the converter cannot see (the rule for "
                "{base} does not apply)",
    "conv1d": ("a Conv1d with kernel > 1 convolves the last dim of a reshaped tensor; the converter cannot tell "
               "whether that dim holds sharded positions"),
    "convtranspose1d": "a ConvTranspose1d mixes neighbouring positions of a reshaped tensor's last dim",
    "indices": "return_indices=True: the indices would be local to each shard",
    "channel dropout": ("drops whole channels of the field: each rank would draw its own channel mask, so a channel "
                        "would be dropped on some shards only"),
    "rrelu": ("rng='one-process' cannot draw RReLU's slopes as one process: one process draws one for each "
              "negative input of the whole field, in order, which depends on other ranks' values; use LeakyReLU, "
              "or rng='tile'"),
    "random in window attention": ("rng='one-process' reproduces only the dropout of the attention weights (an "
                                   "nn.Dropout named dropout, as CREDIT's); it holds {found}; use rng='tile'"),
    "softmax": "works along dim={dim}, which may be a sharded dim of the field",
    "norm over dims": "normalises over its last {n} dims, which on a field include sharded dims",
    "pad": ("pads a sharded dim, so each shard would be padded at its own edges; use the convolution's padding, or "
            "an nn.ZeroPad2d directly before an unpadded Conv2d in an nn.Sequential"),
    "sequence": "attends or recurs over a sequence, which may hold sharded positions",
    "unknown": ("not known to be local along the sharded dims (the converter decides each layer by its type and "
                "cannot see what a forward does)"),
}

_CONVERTED = (Wrapper, DomainParallelInterpolate, HaloExchange, DomainParallelTensorPadding)
_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
                nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Hardshrink,
                nn.Softshrink, nn.Tanhshrink, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Threshold)
_PADS = tuple(getattr(nn, f"{kind}Pad{n}d") for kind in ("Zero", "Constant", "Reflection", "Replication", "Circular")
              for n in (1, 2, 3) if hasattr(nn, f"{kind}Pad{n}d"))
_NORMS_OVER_LAST = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)
_SEQUENCES = (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
              nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


def window_attention_like(module):
    """True for a windowed attention module, such as CREDIT's CrossFormer ``Attention`` (see window_attention_spec)."""
    return window_attention_spec(module) is not None


def child_reasons(parent):
    """Return ``{child name: why it stays local}`` that the blocks of :data:`CHILD_RULES` make of ``parent``."""
    reasons = {}
    for rule in CHILD_RULES:
        reasons.update(rule(parent) or {})
    return reasons


def axis_of(module, shard_dim):
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
    return all(local(module, axis_of(module, d)) for d in shard_dims(shard_dim))


def _pad_dims(pad):
    name = type(pad).__name__
    return int(name[-2]) if name[-2].isdigit() else 2


def _pad_local(pad, shard_dim):
    """True if padding module ``pad`` (F.pad order: last dim first) pads no sharded dim."""
    widths = tuple(pad.padding) if isinstance(pad.padding, (tuple, list)) else (pad.padding,) * (2 * _pad_dims(pad))
    for d in shard_dims(shard_dim):
        index = 2 * (-d - 1)
        if index + 1 < len(widths) and (widths[index] or widths[index + 1]):
            return False
    return True


def _softmax_local(dim, shard_dim):
    if dim is None:
        return False
    return dim in (0, 1) or (dim < 0 and dim not in shard_dims(shard_dim))


def _normalized_shape(norm):
    shape = norm.normalized_shape
    return tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)


def _torch_base(module):
    """The first class in ``module``'s MRO that torch.nn defines (``nn.Module`` for a user module)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.modules"):
            return cls
    return nn.Module


def _has_children(module):
    return any(child is not None for child in module._modules.values())


def _own_forward(module, context):
    base = _torch_base(module)
    return base is not nn.Module and getattr(type(module), "forward") is not getattr(base, "forward")


def _subclass(module, context):
    if _has_children(module):
        return Decision.visit(LOCAL_REASONS["forward unseen"])
    return Decision.refuse(_REFUSALS["subclass"].format(base=_torch_base(module).__name__))


def _wrap(local, reason, wrappers):
    """The action of a convolution rule: local if ``local`` holds along every sharded dim, else wrapped."""
    def action(module, context):
        if _local_along(local, module, context.shard_dim):
            return Decision.local(reason)
        wrapper = next(w for base, w in wrappers if isinstance(module, base))
        return Decision.convert(wrapper(module, context.shard_dim, context.manager))
    return action


def _block(matches, factory):
    """A rule for a block :data:`~mpidomain.nn.blocks.BLOCK_CONVERTERS`-style: matched whole, replaced whole."""
    layer = _BLOCK_LAYERS.get(matches.__name__, f"a block `{matches.__name__}` matches")
    return Rule(matches.__name__, lambda module, context: matches(module),
                lambda module, context: Decision.convert(factory(module, context.shard_dim, context.manager),
                                                         f"matched by {matches.__name__}"),
                layer=layer,
                outcomes=(("convert", "", f"replaced whole: `{factory.__name__}`"),))


_BLOCK_LAYERS = {"coordinate_attention_like": "a coordinate-attention block (`mpidomain.nn.blocks.BLOCK_CONVERTERS`), "
                                              "matched by its children: `pool_h`, `pool_w`, `conv1`, `bn1`, `act`, "
                                              "`conv_h`, `conv_w`, `sigmoid`"}


def _exactly(*types):
    return lambda module, context: type(module) in types


def _pool(module, context):
    if getattr(module, "return_indices", False):
        return Decision.refuse(_REFUSALS["indices"])
    wrapper = _POOLS[type(module)]
    return Decision.convert(wrapper(module, context.shard_dim, context.manager))


_POOLS = {nn.MaxPool2d: DomainParallelMaxPool2d, nn.AvgPool2d: DomainParallelAvgPool2d,
          nn.AdaptiveAvgPool2d: DomainParallelAdaptiveAvgPool2d, nn.AdaptiveMaxPool2d: DomainParallelAdaptiveMaxPool2d}


def _convert_with(factory):
    return lambda module, context: Decision.convert(factory(module, context.shard_dim, context.manager))


def _conv1d(module, context):
    if module.kernel_size == (1,) and module.stride == (1,) and conv_padding(module) == [(0, 0)]:
        return Decision.local(LOCAL_REASONS["pointwise conv"])
    return Decision.refuse(_REFUSALS["conv1d"])


def _conv_transpose1d(module, context):
    if _local_transposed(module, 0):
        return Decision.local(LOCAL_REASONS["transposed kernel = stride"])
    return Decision.refuse(_REFUSALS["convtranspose1d"])


_RANDOM_LAYERS = (nn.AlphaDropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout, nn.RReLU)


def _drop_path_like(module, context):
    """timm's ``DropPath`` (``drop_prob``) or torchvision's ``StochasticDepth`` (``p``, ``mode``), leaves."""
    name = type(module).__name__
    return not _has_children(module) and (name == "DropPath" and hasattr(module, "drop_prob") or
                                          name == "StochasticDepth" and hasattr(module, "p"))


def _rrelu(module, context):
    if context.rng == "one-process":
        return Decision.refuse(_REFUSALS["rrelu"])
    return Decision.convert(DomainParallelRReLU(module, context.shard_dim, context.manager), "rng='tile'")


def _dropout(module, context):
    return Decision.convert(DomainParallelDropout(module, context.rng, context.shard_dim, context.manager),
                            f"rng={context.rng!r}")


def _window_attention(module, context):
    if context.rng == "one-process":
        found = sorted({f"{type(m).__name__} {name}" for name, m in module.named_modules()
                        if isinstance(m, _RANDOM_LAYERS) or _drop_path_like(m, context)
                        or type(m) is nn.Dropout and name != "dropout"})
        if found:
            return Decision.refuse(_REFUSALS["random in window attention"].format(found=", ".join(found)))
    return Decision.convert(DomainParallelWindowAttention(module, manager=context.manager, rng=context.rng),
                            "matched by window_attention_like")


def _channel_dropout(module, context):
    return Decision.local(LOCAL_REASONS["identity"]) if module.p == 0 else Decision.refuse(_REFUSALS["channel dropout"])


def _softmax(module, context):
    if _softmax_local(module.dim, context.shard_dim):
        return Decision.local(LOCAL_REASONS["softmax"])
    return Decision.refuse(_REFUSALS["softmax"].format(dim=module.dim))


def _norm_over_last(module, context):
    n = len(_normalized_shape(module))
    return Decision.local(LOCAL_REASONS["last dim"]) if n == 1 else Decision.refuse(
        _REFUSALS["norm over dims"].format(n=n))


def _pad(module, context):
    return Decision.local(LOCAL_REASONS["pad"]) if _pad_local(module, context.shard_dim) else Decision.refuse(
        _REFUSALS["pad"])


def _local(reason, condition=""):
    return (("local", condition, reason),)


_CONV_LOCAL = "kernel 1, stride 1 and no padding along every sharded dim"
_TRANSPOSED_LOCAL = "kernel = stride and no padding along every sharded dim"

#: The built-in rules, first rule first (after ``allow_local`` and your rules).
BUILTIN_RULES = (
    Rule("domain-parallel already", _CONVERTED,
         Decision.local("domain-parallel already"),
         layer="a `DomainParallelModule` (every layer of `mpidomain.nn`, yours too), `DomainParallelInterpolate`, "
               "`HaloExchange`, `DomainParallelTensorPadding`",
         outcomes=_local("domain-parallel already: it and its children stay (converting twice changes nothing)")),
    Rule("block child", lambda module, context: context.name in context.child_reasons,
         lambda module, context: Decision.local(context.child_reasons[context.name], typed=False),
         layer="a child a block's structure makes local (`mpidomain.nn.blocks.CHILD_RULES`): an ECA block's "
               "`Conv1d` (next to `avg_pool = AdaptiveAvgPool2d(1)` and `sigmoid`)",
         outcomes=_local("it convolves the channels of the replicated global mean")),
    *(_block(matches, factory) for matches, factory in BLOCK_CONVERTERS),
    Rule("window attention", lambda module, context: window_attention_like(module), _window_attention,
         layer="a window attention (CREDIT's CrossFormer `Attention`: `attn_type` \"short\"/\"long\", "
               "`window_size`, `to_qkv`, `to_out`, `rel_pos_indices`)",
         outcomes=(("convert", "", "replaced whole: `DomainParallelWindowAttention` (whole windows dealt out by an "
                                   "all-to-all, and back; its `nn.Dropout` children draw as `rng` says)"),
                   ("refuse", "`rng='one-process'` and another random layer inside",
                    _REFUSALS["random in window attention"].format(found="<layers>")))),
    Rule("channel LayerNorm",
         lambda module, context: channel_layer_norm_like(module) and type(module).__name__ == "LayerNorm",
         Decision.local(LOCAL_REASONS["channel norm"]),
         layer="a leaf `LayerNorm` with parameters `g`, `b` of shape (1, C, 1, 1) (CREDIT's channel LayerNorm)"),
    Rule("torch subclass with its own forward", _own_forward, _subclass,
         layer="a subclass of a torch layer with its own `forward`",
         outcomes=(("visit", "it has children", LOCAL_REASONS["forward unseen"]),
                   ("refuse", "no children", _REFUSALS["subclass"].format(base="<layer>")))),
    Rule("convolution", (nn.Conv2d, nn.Conv3d),
         _wrap(_local_conv, LOCAL_REASONS["pointwise conv"],
               ((nn.Conv2d, DomainParallelConv2d), (nn.Conv3d, DomainParallelConv3d))),
         outcomes=(("local", _CONV_LOCAL, LOCAL_REASONS["pointwise conv"]),
                   ("convert", "otherwise", "`DomainParallelConv2d`/`3d`: the rows each output row needs, through "
                                            "one halo exchange (a 1x1 stride-2 one too: odd first rows)"))),
    Rule("transposed convolution", (nn.ConvTranspose2d, nn.ConvTranspose3d),
         _wrap(_local_transposed, LOCAL_REASONS["transposed kernel = stride"],
               ((nn.ConvTranspose2d, DomainParallelConvTranspose2d), (nn.ConvTranspose3d,
                                                                      DomainParallelConvTranspose3d))),
         outcomes=(("local", _TRANSPOSED_LOCAL, LOCAL_REASONS["transposed kernel = stride"]),
                   ("convert", "otherwise", "`DomainParallelConvTranspose2d`/`3d`: input rows [a, b) make outputs "
                                            "[a*stride, b*stride)"))),
    Rule("Conv1d", nn.Conv1d, _conv1d,
         outcomes=(("local", "kernel 1, stride 1, no padding", LOCAL_REASONS["pointwise conv"]),
                   ("refuse", "otherwise", _REFUSALS["conv1d"]))),
    Rule("ConvTranspose1d", nn.ConvTranspose1d, _conv_transpose1d,
         outcomes=(("local", "kernel = stride, no padding", LOCAL_REASONS["transposed kernel = stride"]),
                   ("refuse", "otherwise", _REFUSALS["convtranspose1d"]))),
    Rule("GroupNorm", nn.GroupNorm, _convert_with(DomainParallelGroupNorm),
         outcomes=(("convert", "", "`DomainParallelGroupNorm`: statistics all-reduced over the domain, forward "
                                   "and backward"),)),
    Rule("BatchNorm", lambda module, context: isinstance(module, (nn.BatchNorm2d, nn.BatchNorm3d))
         and not isinstance(module, nn.SyncBatchNorm), _convert_with(DomainParallelBatchNorm),
         layer="`BatchNorm2d`, `BatchNorm3d` (not `SyncBatchNorm`)",
         outcomes=(("convert", "", "`DomainParallelBatchNorm`: batch statistics over the whole field"),)),
    Rule("Upsample", nn.Upsample, _convert_with(DomainParallelInterpolate.from_upsample),
         outcomes=(("convert", "", "`DomainParallelInterpolate`: PyTorch's own taps of the whole field"),)),
    Rule("pool", _exactly(*_POOLS), _pool, layer=", ".join(f"`{t.__name__}`" for t in _POOLS) + " (exactly)",
         outcomes=(("refuse", "`return_indices=True`", _REFUSALS["indices"]),
                   ("convert", "otherwise", "`DomainParallel<pool>`: windows as a strided convolution's, adaptive "
                                            "bins completed by one all-reduce"))),
    Rule("PixelUnshuffle", _exactly(nn.PixelUnshuffle), _convert_with(DomainParallelPixelUnshuffle),
         layer="`PixelUnshuffle` (exactly)",
         outcomes=(("convert", "", "`DomainParallelPixelUnshuffle`: local once every shard's rows are a multiple "
                                   "of r, else every rank raises"),)),
    Rule("PixelShuffle", _exactly(nn.PixelShuffle), Decision.local(LOCAL_REASONS["pixel shuffle"]),
         layer="`PixelShuffle` (exactly)"),
    Rule("RReLU", _exactly(nn.RReLU), _rrelu, layer="`RReLU` (exactly)",
         outcomes=(("convert", "`rng='tile'`", "`DomainParallelRReLU`: each rank's training slopes from its own "
                                               "stream"),
                   ("refuse", "`rng='one-process'`", _REFUSALS["rrelu"]))),
    Rule("activation", _ACTIVATIONS, Decision.local(LOCAL_REASONS["activation"])),
    Rule("Identity", _exactly(nn.Identity), Decision.local(LOCAL_REASONS["identity"]), layer="`Identity` (exactly)"),
    Rule("dropout", _exactly(nn.Dropout, nn.AlphaDropout), _dropout, layer="`Dropout`, `AlphaDropout` (exactly)",
         outcomes=(("convert", "", "`DomainParallelDropout`: `rng='tile'` (default), each rank's mask from its own "
                                   "stream; `rng='one-process'`, one process's mask of the whole field, this "
                                   "rank's part kept"),)),
    Rule("drop path", _drop_path_like, Decision.local(LOCAL_REASONS["drop path"]),
         layer="timm's `DropPath` (`drop_prob`), torchvision's `StochasticDepth` (`p`), by name, leaves"),
    Rule("channel dropout", (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.FeatureAlphaDropout), _channel_dropout,
         outcomes=(("local", "p = 0", LOCAL_REASONS["identity"]), ("refuse", "p > 0", _REFUSALS["channel dropout"]))),
    Rule("softmax", (nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.GLU), _softmax,
         outcomes=(("local", "dim 0, 1 or a negative dim that is not sharded", LOCAL_REASONS["softmax"]),
                   ("refuse", "otherwise", _REFUSALS["softmax"].format(dim="<dim>")))),
    Rule("channel layers", (nn.Softmax2d, nn.LocalResponseNorm, nn.ChannelShuffle),
         Decision.local(LOCAL_REASONS["channels"])),
    Rule("last dim", (nn.Linear, nn.Bilinear), Decision.local(LOCAL_REASONS["last dim"])),
    Rule("norm over last dims", _NORMS_OVER_LAST, _norm_over_last, layer="`LayerNorm`, `RMSNorm` (where torch has it)",
         outcomes=(("local", "over one dim", LOCAL_REASONS["last dim"]),
                   ("refuse", "over several dims", _REFUSALS["norm over dims"].format(n="<n>")))),
    Rule("reshape", (nn.Flatten, nn.Unflatten), Decision.local(LOCAL_REASONS["reshape"])),
    Rule("lookup", (nn.Embedding, nn.EmbeddingBag), Decision.local(LOCAL_REASONS["lookup"])),
    Rule("padding", _PADS, _pad, layer="padding modules (`ZeroPad2d`, `ReflectionPad2d`, ... `CircularPad3d`)",
         outcomes=(("local", "it pads no sharded dim", LOCAL_REASONS["pad"]), ("refuse", "otherwise",
                                                                               _REFUSALS["pad"]))),
    Rule("sequence", _SEQUENCES, Decision.refuse(_REFUSALS["sequence"]),
         layer="`MultiheadAttention`, `Transformer*`, RNNs (`RNNBase`)"),
    Rule("container", (nn.Sequential, nn.ModuleList, nn.ModuleDict), Decision.visit(),
         outcomes=(("visit", "", "its children are decided"),)),
    Rule("module with children", lambda module, context: _has_children(module),
         Decision.visit(LOCAL_REASONS["forward unseen"]),
         layer="any other module with children (your blocks)"),
    Rule("leaf", lambda module, context: True, Decision.refuse(_REFUSALS["unknown"]),
         layer="any other leaf module (an unknown torch layer, or your layer without children)"),
)


def allow_local_rule(paths=(), types=()):
    """The first rule of every conversion: modules at ``paths`` or of ``types`` stay as they are, children included."""
    paths, types = frozenset(paths), tuple(types)
    return Rule("allow_local", lambda module, context: context.path in paths or isinstance(module, types),
                Decision.local(LOCAL_REASONS["allowed"], typed=False),
                layer="a path or type in `allow_local` (`convert_to_domain_parallel(..., allow_local=(...))`)",
                outcomes=_local("you vouch that it is local (reported as \"allow_local\")"))


#: The converter's own steps between the rules, listed by :func:`rules_table` (documentation only).
_YOUR_RULES = Rule("your rules", lambda module, context: False, Decision.visit(),
                   layer="your rules: `rules=[Rule(...)]`, then `custom_converters` (`{type: factory}`, "
                         "`isinstance` in order)",
                   outcomes=(("convert", "", "the factory's or rule's result; its children are left as made"),
                             ("local", "", "the rule's reason"), ("refuse", "", "the rule's reason"),
                             ("visit", "", "its children are decided")))
_PAIR = Rule("ZeroPad2d before Conv2d", lambda module, context: False, Decision.visit(),
             layer="`ZeroPad2d` directly before an unpadded `Conv2d` in an `nn.Sequential` (CREDIT's CrossEmbed), "
                   "the pad's path not in `allow_local`",
             outcomes=(("convert", "", "its sharded-dim padding moves into the wrapped convolution "
                                       "(`DomainParallelConv2d`); the rest of the pad stays"),))
_PADDED_MODELS = Rule("TensorPadding", lambda module, context: False, Decision.visit(),
                      layer="before the modules: a CREDIT `TensorPadding` held as an attribute (`model.padding_opt`), "
                            "a CrossFormer's final `F.interpolate`",
                      outcomes=(("convert", "", "`DomainParallelTensorPadding`; the interpolation (the identity "
                                                "there) switched off"),))


def table_rules():
    """Return every step the converter takes, in order, as rules (for :func:`rules_table`)."""
    return (_PADDED_MODELS, allow_local_rule(), _YOUR_RULES, _PAIR) + BUILTIN_RULES


def rules_table(rules=None):
    """Return the converter's rules as a markdown table (layer, decision, condition, reason), first rule first.

    :param rules: The rules to list; default: every step of :func:`~mpidomain.nn.convert_to_domain_parallel`
        (``docs/converter-rules.md`` holds this table; the tests check that it does).
    """
    return markdown_table(table_rules() if rules is None else tuple(rules))

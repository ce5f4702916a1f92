"""Models that pad the whole field in their own forward (CREDIT's CrossFormer), recognised by what they hold.

CREDIT's models keep a ``TensorPadding`` as a plain attribute (not a module)
and call ``self.padding_opt.pad(x)`` / ``.unpad(x)`` in ``forward``; CrossFormer
then calls ``F.interpolate(x, size=(image_height, image_width))``, which a
converter cannot reach. :func:`convert_padded_models` replaces every such
attribute by a :class:`DomainParallelTensorPadding` whose blocks start where the
model's strides need them (whole windows of as many early stages as stay balanced),
and moves CrossFormer's interpolation into its ``unpad`` (``resize``): where the
decoder gives back the padded size it is the identity (bilinear with
``align_corners=False`` at scale 1 returns its input bit for bit) and nothing is
resampled; where it gives back fewer rows (801 padded rows through four stride-2
stages come back as 800: CREDIT's 0.25-degree example) the cut field is resampled
to ``(image_height, image_width)`` on the shards. A CrossFormer without padding
gets one of width 0, so that its rows are dealt out in the same aligned blocks.
"""

import math

from .earth_padding import DomainParallelTensorPadding, is_tensor_padding

__all__ = ["channel_layer_norm_like", "convert_padded_models", "crossformer_alignments", "plan_padded_models"]


def _short_windows(module):
    return [m.window_size for m in module.modules()
            if getattr(m, "attn_type", None) == "short" and isinstance(getattr(m, "window_size", None), int)]


def _stride(cross_embed):
    strides = {conv.stride[0] for conv in cross_embed.modules() if hasattr(conv, "stride") and
               isinstance(getattr(conv, "stride", None), tuple)}
    return strides.pop() if len(strides) == 1 else None


def crossformer_alignments(model):
    """Return ``(needed, preferred)`` for a padded CrossFormer, or None if it is not one.

    ``needed``: the rows a shard must start at a multiple of, the product of the stages' strides (the
    skip connections meet there again). ``preferred``: coarser alignments, each also holding whole short
    windows of the first 1, 2, ... stages (the cumulative stride times the stage's window), so that those
    stages' attention moves no rows; :class:`DomainParallelTensorPadding` takes the coarsest that stays
    balanced.
    """
    layers = getattr(model, "layers", None)
    if layers is None or not all(len(stage) == 2 for stage in layers):
        return None
    strides = [_stride(cross_embed) for cross_embed, _ in layers]
    if None in strides:
        return None
    needed, cumulative, align, preferred = math.prod(strides), 1, math.prod(strides), []
    for stride, (_, transformer) in zip(strides, layers):
        cumulative *= stride
        align = math.lcm(align, *[cumulative * w for w in _short_windows(transformer)])
        if align != needed:
            preferred.append(align)
    return needed, tuple(sorted(set(preferred)))


def _is_crossformer(model):
    return all(hasattr(model, a) for a in ("use_interp", "image_height", "image_width", "patch_height",
                                           "patch_width", "layers", "up_block4"))


def channel_layer_norm_like(module):
    """True for a leaf module shaped like CREDIT's channel ``LayerNorm``: parameters ``g`` and ``b`` of shape
    (1, C, 1, 1) and a float ``eps``; it normalises each position over channels, so it is local."""
    params = dict(module.named_parameters(recurse=False))
    if module._modules or set(params) != {"g", "b"} or not isinstance(getattr(module, "eps", None), float):
        return False
    shapes = {tuple(p.shape) for p in params.values()}
    return len(shapes) == 1 and len(next(iter(shapes))) == 4 and next(iter(shapes))[::2] == (1, 1) \
        and next(iter(shapes))[3] == 1


def plan_padded_models(model, manager=None):
    """Return what :func:`convert_padded_models` would change: [(module, attribute, new value, path, what)].

    Local; changes nothing; raises ValueError naming the module path where the result could not be exact.
    """
    plan = []
    for path, module in model.named_modules():
        for name, value in vars(module).items():
            if not is_tensor_padding(value):
                continue
            where = f"{path}.{name}" if path else name
            align, prefer, resize = _alignments(module)
            replacement = DomainParallelTensorPadding.from_tensor_padding(value, align=(align, align), prefer=prefer,
                                                                          resize=resize, manager=manager)
            plan.append((module, name, replacement, where, f"TensorPadding(mode={value.mode!r}) -> "
                                                           f"{_words(align, prefer, resize)}"))
        if _is_crossformer(module) and not getattr(module, "use_padding", True):
            # No padding: a zero-width one still deals the rows out in aligned blocks, and back.
            align, prefer, resize = _alignments(module)
            where = f"{path}.padding_opt" if path else "padding_opt"
            zero = DomainParallelTensorPadding("earth", (0, 0), (0, 0), align=(align, align), prefer=prefer,
                                               resize=resize, manager=manager)
            plan.append((module, "padding_opt", zero,
                         where, f"no padding -> {_words(align, prefer, resize)} of width 0: the rows dealt out in "
                                "aligned blocks"))
            plan.append((module, "use_padding", True, f"{path}.use_padding" if path else "use_padding",
                         "switched on for the zero-width padding"))
        if _is_crossformer(module) and (module.patch_height != 1 or module.patch_width != 1):
            raise ValueError(f"{path or '<model>'}: a CrossFormer with patches ({module.patch_height}x"
                             f"{module.patch_width}) reshapes to the whole field's patch grid and interpolates its "
                             "output with F.interpolate inside forward, which the converter cannot reach; use "
                             "patch_height=patch_width=1")
        if _is_crossformer(module) and module.use_interp:
            where = f"{path}.use_interp" if path else "use_interp"
            plan.append((module, "use_interp", False, where,
                         "F.interpolate to (image_height, image_width) done by the padding's unpad (resize): the "
                         "identity where the decoder gives back the padded size"))
    return plan


def _alignments(module):
    """(needed, preferred, resize) of a module holding a padding: a CrossFormer's, else (1, (), None)."""
    if not _is_crossformer(module):
        return 1, (), None
    needed, prefer = crossformer_alignments(module) or (1, ())
    resize = (int(module.image_height), int(module.image_width)) if module.use_interp else None
    return needed, prefer, resize


def _words(align, prefer, resize):
    return (f"DomainParallelTensorPadding(align={align}" + (f", prefer={prefer}" if prefer else "")
            + (f", resize={resize}" if resize else "") + ")")


def convert_padded_models(model, manager=None):
    """Replace ``TensorPadding`` attributes in ``model`` (in place); return [(path, what was done)].

    Local; raises ValueError naming the module path where the result could not be exact.
    """
    plan = plan_padded_models(model, manager)
    for module, name, value, _, _ in plan:
        setattr(module, name, value)
    return [(path, what) for _, _, _, path, what in plan]

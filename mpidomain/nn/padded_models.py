"""Models that pad the whole field in their own forward (CREDIT's CrossFormer), recognised by what they hold.

CREDIT's models keep a ``TensorPadding`` as a plain attribute (not a module)
and call ``self.padding_opt.pad(x)`` / ``.unpad(x)`` in ``forward``; CrossFormer
then calls ``F.interpolate(x, size=(image_height, image_width))``, which a
converter cannot reach. :func:`convert_padded_models` replaces every such
attribute by a :class:`DomainParallelTensorPadding` whose blocks start where the
model's strides and short windows need them, and switches CrossFormer's
interpolation off where it is the identity (the decoder gives back the padded
size, so after ``unpad`` the field already has ``(image_height, image_width)``:
bilinear with ``align_corners=False`` at scale 1 returns its input bit for bit).
"""

import math

from .earth_padding import DomainParallelTensorPadding, is_tensor_padding

__all__ = ["convert_padded_models", "crossformer_align"]


def _short_windows(module):
    return [m.window_size for m in module.modules()
            if getattr(m, "attn_type", None) == "short" and isinstance(getattr(m, "window_size", None), int)]


def _stride(cross_embed):
    strides = {conv.stride[0] for conv in cross_embed.modules() if hasattr(conv, "stride") and
               isinstance(getattr(conv, "stride", None), tuple)}
    return strides.pop() if len(strides) == 1 else None


def crossformer_align(model):
    """Return the latitude rows a padded CrossFormer shard must start at a multiple of, or None if not one.

    The product of the stages' strides (the skip connections meet there again), and at
    each stage the cumulative stride times its short window (windows whole on one rank).
    """
    layers = getattr(model, "layers", None)
    if layers is None or not all(len(stage) == 2 for stage in layers):
        return None
    align, cumulative = 1, 1
    for cross_embed, transformer in layers:
        stride = _stride(cross_embed)
        if stride is None:
            return None
        cumulative *= stride
        align = math.lcm(align, cumulative, *[cumulative * w for w in _short_windows(transformer)])
    return align


def _is_crossformer(model):
    return all(hasattr(model, a) for a in ("use_interp", "image_height", "image_width", "patch_height",
                                           "patch_width", "layers", "up_block4"))


def convert_padded_models(model, manager=None):
    """Replace ``TensorPadding`` attributes in ``model`` (in place); return [(path, what was done)].

    Local; raises ValueError naming the module path where the result could not be exact.
    """
    done = []
    for path, module in list(model.named_modules()):
        for name, value in list(vars(module).items()):
            if not is_tensor_padding(value):
                continue
            where = f"{path}.{name}" if path else name
            align = crossformer_align(module) if _is_crossformer(module) else None
            setattr(module, name, DomainParallelTensorPadding.from_tensor_padding(
                value, align=(align or 1, align or 1), manager=manager))
            done.append((where, f"TensorPadding(mode={value.mode!r}) -> DomainParallelTensorPadding"
                                f"(align={align or 1})"))
        if _is_crossformer(module) and module.use_interp:
            where = f"{path}.use_interp" if path else "use_interp"
            if module.patch_height != 1 or module.patch_width != 1:
                raise ValueError(f"{where}: a CrossFormer with patches ({module.patch_height}x{module.patch_width}) "
                                 "interpolates its output with F.interpolate inside forward, which the converter "
                                 "cannot reach; use patch_height=patch_width=1")
            module.use_interp = False
            done.append((where, "F.interpolate to (image_height, image_width) is the identity: switched off"))
    return done

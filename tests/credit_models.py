"""Import CREDIT's model modules (``miles-credit``, installed --no-deps) for the tests and scripts.

CrossFormer's module imports ``credit.postblock.gen1`` (its optional post-processing
block), which reaches torchvision through ``credit.transforms`` and
``segmentation_models_pytorch``/timm. PyPI's torchvision wheels for Linux are built
against CUDA torch and cannot load next to the CPU torch the suite runs on. Where
that import fails, :func:`crossformer` registers a ``credit.postblock.gen1`` whose
``PostBlock`` raises the original ImportError: CrossFormer builds one only when
``post_conf["activate"]`` is set, which these tests never do. The models themselves
are CREDIT's classes, unchanged.
"""

import importlib
import sys
import types

__all__ = ["crossformer", "unet", "unet_attention_modules", "unet_diffusion", "why_missing"]


def _post_block_placeholder(error):
    module = types.ModuleType("credit.postblock.gen1")

    class PostBlock:
        def __init__(self, *args, **kwargs):
            raise ImportError(f"CREDIT's PostBlock needs torchvision, which failed to import here: {error}")

    module.PostBlock = PostBlock
    return module


def crossformer():
    """Return ``credit.models.wxformer.crossformer``; ImportError if CREDIT or einops is missing."""
    importlib.import_module("credit")
    if "credit.postblock.gen1" not in sys.modules:
        try:
            importlib.import_module("credit.postblock.gen1")
        except (ImportError, RuntimeError) as error:  # RuntimeError: a CUDA torchvision beside CPU torch
            sys.modules["credit.postblock.gen1"] = _post_block_placeholder(error)
    return importlib.import_module("credit.models.wxformer.crossformer")


def unet_attention_modules():
    """Return ``credit.models.unet_attention_modules`` (SCSE, ECA, coordinate attention)."""
    return importlib.import_module("credit.models.unet_attention_modules")


def unet_diffusion():
    """Return ``credit.models.unet_diffusion`` (needs scipy)."""
    return importlib.import_module("credit.models.unet_diffusion")


def unet():
    """Return ``credit.models.unet`` (needs segmentation_models_pytorch, hence timm and a loadable torchvision)."""
    crossformer()
    return importlib.import_module("credit.models.unet")


def why_missing(loader):
    """Return None if ``loader()`` imports, else the reason (the same on every rank of one installation)."""
    try:
        loader()
    except Exception as error:  # ImportError, or torchvision's RuntimeError on a CUDA wheel beside CPU torch
        return f"{type(error).__name__}: {error}".splitlines()[0][:200]
    return None

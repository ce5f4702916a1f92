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

from mpidomain.models import credit_crossformer_module

__all__ = ["crossformer", "unet", "unet_attention_modules", "unet_diffusion", "why_missing"]


def crossformer():
    """Return ``credit.models.wxformer.crossformer``; ImportError if CREDIT or einops is missing."""
    return credit_crossformer_module()


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

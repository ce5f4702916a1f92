"""Mixed precision in the domain-parallel layers: what ``torch.autocast`` would do to the layer they replace.

A converted layer is not the aten operator autocast knows, so it applies autocast's policy itself:

- a convolution's input is cast to the autocast dtype before its halo exchange (:func:`conv_input`): the
  halos travel in bfloat16 or float16, and the convolution sees the values autocast would give it (a cast
  commutes with padding and copying rows);
- a normalisation, pool or interpolation of a float16/bfloat16 field computes in float32 and rounds once
  at the end (:func:`float32_work`), as PyTorch's own kernels accumulate in float32; its output has the
  dtype PyTorch's would have (:func:`output_dtype`): the input's, except where autocast's float32 policy
  casts the operator's input (GroupNorm and LayerNorm on CUDA): float32.

Local, no communication; every rank takes the same decisions from the same autocast state.
"""

import torch

__all__ = ["HALF", "conv_input", "float32_work", "output_dtype", "work_dtype"]

HALF = (torch.float16, torch.bfloat16)

# Operators autocast runs in float32 on a device type (casting a lower-precision input up).
_FLOAT32_POLICY = {"cuda": ("group_norm", "layer_norm")}


def _autocast_dtype(x):
    """The dtype autocast casts ``x`` to for a lower-precision operator, or None (no autocast, or x not eligible)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    return torch.get_autocast_dtype(device)


def conv_input(x):
    """Return ``x`` as a convolution under autocast would see it: cast to the autocast dtype (else ``x``)."""
    dtype = _autocast_dtype(x)
    return x if dtype is None or dtype == x.dtype else x.to(dtype)


def output_dtype(x, operator):
    """The dtype PyTorch's ``operator`` (e.g. ``"group_norm"``) returns for ``x`` here, autocast included."""
    if x.dtype in HALF and _autocast_dtype(x) is not None and operator in _FLOAT32_POLICY.get(x.device.type, ()):
        return torch.float32
    return x.dtype


def work_dtype(dtype):
    """The dtype a layer computes in for inputs of ``dtype``: float32 for float16/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in HALF else dtype


def float32_work(x):
    """Return ``x`` in the dtype a layer computes in (:func:`work_dtype`): float32 for float16/bfloat16, else ``x``."""
    return x.float() if x.dtype in HALF else x

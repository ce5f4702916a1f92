"""Torch building blocks for domain- and data-parallel training (importing this imports torch).

Domain-parallel layers equal their single-process twins in forward and
backward; :func:`convert_to_domain_parallel` puts them into a model.
"""

from .conv import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                   DomainParallelConvTranspose3d, DomainParallelPeriodicConv2d)
from .convert import convert_to_domain_parallel
from .earth_padding import DomainParallelTensorPadding
from .gradients import allreduce_gradients
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .memory import SavedActivations
from .norm import DomainParallelGroupNorm
from .redistribution import Redistribute
from .window_attention import DomainParallelWindowAttention, WindowAttentionSpec, window_attention_spec

__all__ = [
    "HaloExchange",
    "allreduce_gradients",
    "DomainParallelConv2d",
    "DomainParallelConv3d",
    "DomainParallelConvTranspose2d",
    "DomainParallelConvTranspose3d",
    "DomainParallelPeriodicConv2d",
    "DomainParallelGroupNorm",
    "DomainParallelInterpolate",
    "DomainParallelTensorPadding",
    "DomainParallelWindowAttention",
    "Redistribute",
    "WindowAttentionSpec",
    "window_attention_spec",
    "convert_to_domain_parallel",
    "SavedActivations",
]

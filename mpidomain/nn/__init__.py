"""Torch building blocks for domain- and data-parallel training (importing this imports torch).

Domain-parallel layers equal their single-process twins in forward and
backward; :func:`convert_to_domain_parallel` puts them into a model, module by
module, by ordered :class:`Rule` objects (yours first; :func:`rules_table`).
"""

from .conv import (DomainParallelConv2d, DomainParallelConv3d, DomainParallelConvTranspose2d,
                   DomainParallelConvTranspose3d, DomainParallelPeriodicConv2d)
from .blocks import DomainParallelCoordinateAttention
from .builtin_rules import BUILTIN_RULES, rules_table
from .convert import ConversionReport, convert_to_domain_parallel
from .earth_padding import DomainParallelTensorPadding
from .dropout import DomainParallelDropout, DomainParallelRReLU
from .estimate import DrawEstimate, MemoryEstimate, estimate_draws, estimate_memory
from .gradients import allreduce_gradients
from .halo import HaloExchange
from .interpolate import DomainParallelInterpolate
from .memory import SavedActivations
from .module import DomainParallelModule
from .metrics import LatitudeWeightedMSE, latitude_weighted_acc, latitude_weighted_rmse, latitude_weights
from .norm import DomainParallelBatchNorm, DomainParallelGroupNorm
from .overlap import overlap_default, set_overlap
from .pool import (DomainParallelAdaptiveAvgPool2d, DomainParallelAdaptiveMaxPool2d, DomainParallelAvgPool2d,
                   DomainParallelMaxPool2d)
from .redistribution import Redistribute
from .rule import Decision, Rule, RuleContext
from .shuffle import DomainParallelPixelUnshuffle
from .stats import CommStats
from .training import AgreedGradScaler, TrainingOptions, TrainingSetup, prepare_training
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
    "DomainParallelBatchNorm",
    "DomainParallelInterpolate",
    "DomainParallelTensorPadding",
    "DomainParallelWindowAttention",
    "DomainParallelDropout",
    "DomainParallelRReLU",
    "Redistribute",
    "WindowAttentionSpec",
    "window_attention_spec",
    "DomainParallelMaxPool2d",
    "DomainParallelAvgPool2d",
    "DomainParallelAdaptiveAvgPool2d",
    "DomainParallelAdaptiveMaxPool2d",
    "DomainParallelPixelUnshuffle",
    "DomainParallelCoordinateAttention",
    "ConversionReport",
    "convert_to_domain_parallel",
    "DomainParallelModule",
    "Rule",
    "Decision",
    "RuleContext",
    "BUILTIN_RULES",
    "rules_table",
    "SavedActivations",
    "CommStats",
    "overlap_default",
    "set_overlap",
    "MemoryEstimate",
    "estimate_memory",
    "DrawEstimate",
    "estimate_draws",
    "latitude_weights",
    "LatitudeWeightedMSE",
    "latitude_weighted_rmse",
    "latitude_weighted_acc",
    "TrainingOptions",
    "TrainingSetup",
    "prepare_training",
    "AgreedGradScaler",
]

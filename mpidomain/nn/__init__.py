"""Torch building blocks for domain- and data-parallel training (importing this imports torch)."""

from .gradients import allreduce_gradients
from .halo import HaloExchange

__all__ = ["HaloExchange", "allreduce_gradients"]

"""Torch building blocks for domain- and data-parallel training (importing this imports torch)."""

from .gradients import allreduce_gradients

__all__ = ["allreduce_gradients"]

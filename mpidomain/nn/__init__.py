"""Differentiable domain-parallel layers for PyTorch (import this module only where torch is installed)."""

from .halo import HaloExchange

__all__ = ["HaloExchange"]

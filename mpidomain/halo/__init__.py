"""The halo engine: exchange plans built once and reused, and the call that finds them.

- :mod:`~mpidomain.halo.spec`: :class:`HaloSpec`, what a call asks for (agreed across ranks);
- :mod:`~mpidomain.halo.plan`: :class:`HaloPlan`, neighbours, datatypes, buffers and requests of one
  exchange, with ``start``/``wait`` so compute can overlap;
- :mod:`~mpidomain.halo.cache`: the plans a manager keeps, least recently used out first;
- :mod:`~mpidomain.halo.call`: :func:`halo_exchange`, its agreement step and autograd function.

Which rows go where is :mod:`mpidomain.layout`'s arithmetic; this package moves the bytes.
"""

from .call import halo_exchange
from .plan import HaloPlan

__all__ = ["HaloPlan", "halo_exchange"]

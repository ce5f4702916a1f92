"""The argument checks every entry point shares: ints and dims (the manager to work on: ``_current.require_manager``).

Local: no communication. Each raises the built-in exception whose meaning
fits, naming the argument, what was expected, what was received and the fix.
"""

import numbers

import numpy as np


def is_int(value):
    """Return True for an integer that is not a bool (Python or NumPy)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def require_int(name, value, least=None, hint=""):
    """Return ``value`` as an int; raise TypeError if it is no int, ValueError if below ``least``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}){'; ' + hint if hint else ''}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}{'; ' + hint if hint else ''}")
    return int(value)


def normalize_dim(dim, shape, name="dim"):
    """Return ``dim`` as an index in ``range(len(shape))``; raise TypeError/ValueError naming the fix."""
    require_int(name, dim, hint="e.g. -2 for latitude in (B, C, H, W)")
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{name}={dim} is out of range for a {ndim}-d array of shape {tuple(shape)}; "
            f"pass a {name} between {-ndim} and {ndim - 1}"
        )
    return int(dim) % ndim


#: How a converted model's random layers draw (:mod:`mpidomain.nn.rng`; the command lines' ``--rng``).
RNG_MODES = ("tile", "one-process")


def check_rng(rng, name="rng"):
    """Return ``rng`` if it is one of :data:`RNG_MODES`; ValueError naming ``name`` otherwise."""
    if rng not in RNG_MODES:
        raise ValueError(f"{name} must be 'tile' (each rank its own stream, the default) or 'one-process' (the "
                         f"draws of one process), got {rng!r}")
    return rng

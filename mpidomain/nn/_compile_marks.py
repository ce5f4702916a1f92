"""The marks ``torch.compile`` reads on the library's functions, put on when Dynamo loads: :func:`constant_result`,
:func:`compile_disabled`, :func:`substitute`.

``torch.compiler.assume_constant_result``, ``disable`` and ``substitute_in_graph`` each import Dynamo
(``torch._dynamo``, with sympy and its tables) when applied: about 1.5 s of CPU for every process that imports
:mod:`mpidomain.nn`, 6 s for a 4-rank job, whether it compiles or not. Dynamo reads the marks only while it
traces, so here they wait: each is applied right after ``torch._dynamo`` finishes loading (a finder on
``sys.meta_path`` wraps its loader, once), or at once where it is loaded already. A compiled model finds the same
marks as with the decorators applied at import (``tests/test_imports.py``). Local.
"""

import functools
import importlib.abc
import sys

import torch

__all__ = ["constant_result", "compile_disabled", "substitute"]

_DYNAMO = "torch._dynamo"
_PENDING = []  # the marks to apply once Dynamo has loaded, in the order they were asked for


def _loaded():
    """True once ``torch._dynamo`` has finished loading."""
    module = sys.modules.get(_DYNAMO)
    return module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False


def _when_dynamo(apply):
    """Call ``apply()`` now if Dynamo is loaded, else right after it loads."""
    if _loaded():
        apply()
        return
    _PENDING.append(apply)
    if not any(isinstance(finder, _DynamoFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DynamoFinder())


def _apply_pending():
    while _PENDING:
        _PENDING.pop(0)()


class _DynamoFinder(importlib.abc.MetaPathFinder):
    """Find ``torch._dynamo`` with the other finders and wrap its loader; then step aside."""

    def find_spec(self, name, path, target=None):
        if name != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _MarkingLoader(spec.loader)
        return spec


class _MarkingLoader(importlib.abc.Loader):
    """Dynamo's own loader, then the pending marks."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        torch._dynamo = module  # as the import system sets it once this returns: the marks reach Dynamo by it
        _apply_pending()

    def __getattr__(self, name):  # get_code, get_source, is_package, ... of Dynamo's loader
        return getattr(self.loader, name)


def constant_result(fn):
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does (in place, once Dynamo loads); return it."""
    _when_dynamo(lambda: torch.compiler.assume_constant_result(fn))
    return fn


def compile_disabled(fn):
    """Return ``fn`` as ``torch.compiler.disable(fn)`` runs it: never traced, Dynamo off inside it.

    Until Dynamo loads, the returned function calls ``fn`` itself (nothing is compiling); from then on, the
    disabled wrapper.
    """
    if _loaded():
        return torch.compiler.disable(fn)
    target = [fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return target[0](*args, **kwargs)

    _when_dynamo(lambda: target.__setitem__(0, torch.compiler.disable(fn)))
    return call


def substitute(original):
    """Decorator: register the function as what Dynamo traces in place of ``original``
    (``torch.compiler.substitute_in_graph``, once Dynamo loads); return the function unchanged."""
    def register(fn):
        _when_dynamo(lambda: torch.compiler.substitute_in_graph(original)(fn))
        return fn
    return register

"""CREDIT's CrossFormer module for tests, importable without torchvision.

``credit.models.wxformer.crossformer`` imports ``credit.postblock.gen1`` (for
``PostBlock``), which imports ``credit.transforms`` and so torchvision; the
test environment installs CREDIT without its dependencies. Where that import
fails, the module file is loaded under a private name with ``PostBlock``
(which the attention and transformer classes do not use) standing in as an
empty module for the time of the load; ``sys.modules`` is left as it was.
"""

import importlib
import importlib.util
import sys
import types

import pytest

_PRIVATE = "_mpidomain_tests_credit_crossformer"


def crossformer():
    """Return CREDIT's ``credit.models.wxformer.crossformer`` module (skip the test where CREDIT is missing)."""
    pytest.importorskip("credit")
    try:
        return importlib.import_module("credit.models.wxformer.crossformer")
    except ImportError as error:
        if "torchvision" not in str(error):
            raise
    if _PRIVATE in sys.modules:
        return sys.modules[_PRIVATE]
    spec = importlib.util.find_spec("credit.models.wxformer.crossformer")
    stub = types.ModuleType("credit.postblock.gen1")
    stub.PostBlock = None
    saved = {name: sys.modules.get(name) for name in ("credit.postblock.gen1",)}
    sys.modules["credit.postblock.gen1"] = stub
    try:
        private = importlib.util.spec_from_file_location(_PRIVATE, spec.origin)
        module = importlib.util.module_from_spec(private)
        private.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    sys.modules[_PRIVATE] = module
    return module

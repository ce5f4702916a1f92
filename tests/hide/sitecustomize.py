"""Hide packages from this Python, for the suite's tests of missing and broken installs (tests/mpitest.py's
``hiding_env`` puts this folder first on PYTHONPATH).

``MPIDOMAIN_TEST_HIDE=a,b``: importing ``a`` (or ``a.x``) raises ModuleNotFoundError, as if not installed;
``MPIDOMAIN_TEST_BREAK=c``: importing ``c`` raises RuntimeError, as a package built for another torch does.
A probe that only looks for the module (``importlib.util.find_spec``, as torch's compiler does at import) finds
a spec without an origin, and goes on.
"""

import os
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec


class _Failing(Loader):
    def __init__(self, error):
        self.error = error

    def create_module(self, spec):
        raise self.error

    def exec_module(self, module):
        raise self.error


class _Hider(MetaPathFinder):
    def __init__(self, hidden, broken):
        self.hidden, self.broken = hidden, broken

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in self.hidden:
            return ModuleSpec(name, _Failing(ModuleNotFoundError(f"No module named {name!r}", name=name)))
        if top in self.broken:
            return ModuleSpec(name, _Failing(RuntimeError(f"{top} was built for another torch (hidden by the test)")))
        return None


_hidden = {n for n in os.environ.get("MPIDOMAIN_TEST_HIDE", "").split(",") if n}
_broken = {n for n in os.environ.get("MPIDOMAIN_TEST_BREAK", "").split(",") if n}
if _hidden or _broken:
    sys.meta_path.insert(0, _Hider(_hidden, _broken))

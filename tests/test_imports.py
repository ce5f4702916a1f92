"""The package's imports form no cycle: a lower module never reaches up, not even inside a function.

Local (parses the source with ast, imports nothing), so every rank checks alike.
"""

import ast
import pathlib

import pytest

import mpidomain

pytestmark = pytest.mark.one_world  # no MPI: the same in every world

ROOT = pathlib.Path(mpidomain.__file__).parent


def _modules():
    """Return {dotted module name: path} for every module of the package."""
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = ("mpidomain",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph():
    """Return {module: {imported module: first line}} over every import statement, at any depth.

    ``from . import x`` where ``x`` is a submodule counts as importing ``x``
    (not the package). Importing a module of a subpackage also runs that
    subpackage's ``__init__.py``: it counts as an edge too, unless the importer
    is inside that subpackage (its ``__init__`` then runs already); the root
    ``mpidomain/__init__.py`` is not counted (every module would depend on it).
    """
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.append(submodule if submodule in modules else source)
            for target in targets:
                parts = target.split(".")
                # the subpackages Python runs on the way, outside the importer's own
                for ancestor in (".".join(parts[:k]) for k in range(2, len(parts))):
                    if ancestor in modules and not (name + ".").startswith(ancestor + "."):
                        edges.setdefault(ancestor, node.lineno)
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def cycles(graph):
    """Return the import cycles of ``graph``: each strongly connected component of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "mpidomain.cli.demo" in graph["mpidomain.__main__"]  # imported inside a function only


def test_the_graph_sees_the_subpackages_run_on_the_way():
    graph = import_graph()
    assert "mpidomain.halo" in graph["mpidomain.nn.overlap"]  # from ..halo.plan import ...: halo/__init__ runs
    assert "mpidomain.halo" not in graph["mpidomain.halo.call"]  # inside the subpackage: its __init__ runs already


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for component in found:
        members = set(component)
        for module in component:
            lines += [f"{module} -> {target} (line {line})"
                      for target, line in sorted(graph[module].items()) if target in members]
    assert not found, "import cycles in the package:\n  " + "\n  ".join(lines)


def _third_party(path):
    """The top-level names of the absolute imports of the module at ``path`` (at any depth)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_layout_package_is_pure_arithmetic():
    """``mpidomain.layout`` (which rows go where) reaches no module that moves bytes: its imports, followed to the
    end, stay inside it and ``_validate``, and none of them imports MPI, torch or CuPy."""
    graph, modules = import_graph(), _modules()
    reached, pending = set(), [m for m in graph if m == "mpidomain.layout" or m.startswith("mpidomain.layout.")]
    while pending:
        module = pending.pop()
        if module not in reached:
            reached.add(module)
            pending += graph[module]
    outside = sorted(m for m in reached if not m.startswith("mpidomain.layout") and m != "mpidomain._validate")
    assert not outside, f"mpidomain.layout reaches {outside}"
    heavy = {m: sorted(_third_party(modules[m]) & {"mpi4py", "torch", "cupy"}) for m in reached}
    assert not any(heavy.values()), heavy


def test_only_the_command_line_imports_the_credit_integration():
    """``mpidomain.credit`` (CREDIT's configs, data, trainer and outputs) sits on top: no module outside it
    imports it but the command line's dispatcher, ``mpidomain.__main__``."""
    graph = import_graph()
    importers = sorted(m for m, edges in graph.items() if not (m + ".").startswith("mpidomain.credit.")
                       and any(t == "mpidomain.credit" or t.startswith("mpidomain.credit.") for t in edges))
    assert importers == ["mpidomain.__main__"], importers


def test_importing_the_layers_leaves_dynamo_unloaded_and_marks_it_when_it_loads():
    """``import mpidomain.nn`` does not load Dynamo (1.5 s of CPU per process); once anything loads it, every
    function carries the mark ``torch.compile`` reads: a constant result, compiling disabled, a substitute."""
    import subprocess
    import sys

    program = """
import sys
import mpidomain.nn
from mpidomain.nn import dropout, ops, plans, rng
from mpidomain.halo.call import halo_exchange
from mpidomain.reduce import allreduce
assert "torch._dynamo" not in sys.modules, "importing mpidomain.nn loaded Dynamo"
import torch._dynamo
from torch._dynamo.trace_rules import _polyfilled_function_ids
assert ops.handle._dynamo_marked_constant and plans._planned._dynamo_marked_constant
for fn in (ops.raise_on_every_rank, rng.tile_dropout, dropout._tile_rrelu):
    assert getattr(fn.__closure__[0].cell_contents[0], "_torchdynamo_disable", False), fn
assert id(halo_exchange) in _polyfilled_function_ids and id(allreduce) in _polyfilled_function_ids
print("marked")
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "marked", done.stderr[-2000:]

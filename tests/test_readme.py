"""The README's Python blocks are complete programs: each runs as it is under ``mpiexec -n 4``."""

import importlib.util
import os
import re
import time

import pytest

from mpitest import REPO, run_mpi, share

README = os.path.join(REPO, "README.md")


def python_blocks():
    text = open(README).read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_has_programs():
    assert len(python_blocks()) >= 5


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs_verbatim(world, tmp_path_factory, index):
    pytest.importorskip("torch")
    if "from credit." in python_blocks()[index] and importlib.util.find_spec("credit") is None:
        pytest.skip("CREDIT (miles-credit) is not installed: pip install --no-deps miles-credit")
    result = None
    if world.rank == 0:
        script = tmp_path_factory.mktemp("readme") / f"example{index}.py"
        script.write_text(python_blocks()[index])
        started = time.monotonic()
        done = run_mpi(4, [str(script)], timeout=180)
        result = (done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    status, stdout, stderr, _ = share(world, result)
    assert status == 0, f"README block {index} failed:\n{python_blocks()[index]}\n{stderr[-3000:]}"
    assert stdout.count("rank") >= 4, stdout  # every block prints a line per rank

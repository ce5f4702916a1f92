"""The README's Python blocks are complete programs: each runs as it is under ``mpiexec -n 4``."""

import importlib.util
import os
import re
import time

import pytest

from mpitest import REPO, import_credit, run_mpi, share

README = os.path.join(REPO, "README.md")


def python_blocks():
    text = open(README).read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def test_readme_has_programs():
    assert len(python_blocks()) >= 5


@pytest.mark.mpi_job
@pytest.mark.parametrize("index", [pytest.param(i, marks=pytest.mark.credit) if "from credit." in block else i
                                   for i, block in enumerate(python_blocks())])
def test_readme_block_runs_verbatim(world, tmp_path_factory, index):
    pytest.importorskip("torch")
    if "from credit." in python_blocks()[index]:
        import_credit()
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


def _quickstart_script():
    path = os.path.join(REPO, "scripts", "readme_quickstart.py")
    spec = importlib.util.spec_from_file_location("readme_quickstart", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_lines_are_the_readmes_and_ci_runs_them(capsys):
    script = _quickstart_script()
    assert script.main([README]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[0].endswith(" && mpiexec -n 4 python -m mpidomain check"), printed
    assert "pip install '.[mpich,test]'" in printed[1] and printed[1].endswith(" && mpiexec -n 4 python -m pytest")
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert ci.index("scripts/readme_quickstart.py") < ci.index("python3 -m venv \"$venv\"")
    text = "intro\n## Quickstart\n\nno commands\n\n## Next\n\n```bash\nnot this one\n```\n"
    with pytest.raises(ValueError, match="has no ```bash block"):
        script.quickstart_lines(text)
    assert script.quickstart_lines(text.replace("no commands", "```bash\nfirst\n\nsecond\n```")) == ["first", "second"]

"""docs/converter-rules.md: its rules table is rules_table()'s output, and its program runs under mpiexec -n 4."""

import os
import re

import pytest

from mpitest import REPO, run_mpi, share

pytestmark = pytest.mark.one_world  # documents and the jobs they run: the same in every world

PAGE = os.path.join(REPO, "docs", "converter-rules.md")
START, END = "<!-- rules table: mpidomain.nn.rules_table() -->\n", "<!-- end of rules table -->"


def test_the_pages_table_is_the_generated_one():
    nn = pytest.importorskip("mpidomain.nn")
    text = open(PAGE).read()
    assert START in text and END in text, f"{PAGE} lost its table markers"
    table = text[text.index(START) + len(START):text.index(END)]
    assert table == nn.rules_table(), ("docs/converter-rules.md's table differs from the rules; regenerate it: "
                                       "python -c \"import mpidomain.nn as n; print(n.rules_table(), end='')\"")


def python_blocks():
    return re.findall(r"^```python\n(.*?)^```$", open(PAGE).read(), flags=re.S | re.M)


@pytest.mark.mpi_job
def test_the_pages_program_runs_verbatim_on_4_ranks(world, tmp_path_factory):
    pytest.importorskip("torch")
    blocks = python_blocks()
    assert len(blocks) == 1
    result = None
    if world.rank == 0:
        script = tmp_path_factory.mktemp("rules") / "example.py"
        script.write_text(blocks[0])
        done = run_mpi(4, [str(script)], timeout=180)
        result = (done.returncode, done.stdout, done.stderr)
    status, stdout, stderr = share(world, result)
    assert status == 0, f"docs/converter-rules.md's program failed:\n{stderr[-3000:]}"
    assert stdout.count("rank") >= 4, stdout

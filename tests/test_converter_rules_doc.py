"""docs/converter-rules.md: its rules table is rules_table()'s output (its programs run in tests/test_readme.py)."""

import os

import pytest

from mpitest import REPO

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

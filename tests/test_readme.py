"""The README and the pages in docs/: every Python block is a complete program that runs as it is under
``mpiexec -n 4``; the README stays a short entry point; every relative link points to a file that exists."""

import glob
import importlib.util
import os
import re
import time

import pytest

from mpitest import REPO, import_credit, run_mpi, share

pytestmark = pytest.mark.one_world  # documents and the jobs they run: the same in every world

README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
README_MAX_LINES = 420
# How many programs the README held before its reference text moved to docs/: the pages keep at least as many.
PROGRAMS_BEFORE_SPLIT = 14


def doc_files():
    """README.md, then docs/*.md in name order: paths relative to the repository."""
    pages = sorted(os.path.relpath(path, REPO) for path in glob.glob(os.path.join(DOCS, "*.md")))
    return ["README.md"] + [page.replace(os.sep, "/") for page in pages]


def read(name, root=REPO):
    with open(os.path.join(root, name), encoding="utf-8") as file:
        return file.read()


def python_blocks(name="README.md"):
    return re.findall(r"^```python\n(.*?)^```$", read(name), flags=re.S | re.M)


def programs():
    """Every distinct program of the README and of docs/*.md as (file, index, text), the first copy of each.

    The README's examples are copies of programs on the pages; a copy runs once, under its first name.
    """
    seen, found = set(), []
    for name in doc_files():
        for index, block in enumerate(python_blocks(name)):
            if block not in seen:
                seen.add(block)
                found.append((name, index, block))
    return found


def _param(name, index, block):
    marks = [pytest.mark.credit] if "from credit." in block else []
    return pytest.param(name, index, marks=marks, id=f"{name}[{index}]")


def test_readme_has_programs():
    assert len(python_blocks("README.md")) >= 3
    pages = [name for name in doc_files() if name != "README.md"]
    assert sum(len(python_blocks(name)) for name in pages) >= PROGRAMS_BEFORE_SPLIT
    assert len(programs()) >= PROGRAMS_BEFORE_SPLIT


@pytest.mark.mpi_job
@pytest.mark.parametrize("name,index", [_param(*program) for program in programs()])
def test_readme_block_runs_verbatim(world, tmp_path_factory, name, index):
    pytest.importorskip("torch")
    block = python_blocks(name)[index]
    if "from credit." in block:
        import_credit()
    result = None
    if world.rank == 0:
        script = tmp_path_factory.mktemp("readme") / f"{os.path.basename(name)[:-3]}_{index}.py"
        script.write_text(block)
        started = time.monotonic()
        done = run_mpi(4, [str(script)], timeout=180)
        result = (done.returncode, done.stdout, done.stderr, time.monotonic() - started)
    status, stdout, stderr, _ = share(world, result)
    assert status == 0, f"{name} block {index} failed:\n{block}\n{stderr[-3000:]}"
    assert stdout.count("rank") >= 4, stdout  # every block prints a line per rank


def test_readme_is_an_entry_point():
    lines = read("README.md").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference text to docs/"


def relative_links(name, root=REPO):
    """The targets of the Markdown links and images of ``name`` that are not URLs, outside code."""
    text = re.sub(r"^```.*?^```$", "", read(name, root), flags=re.S | re.M)  # fenced blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    targets = re.findall(r"!?\[[^\]\n]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)", text)
    return [target for target in targets if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)]


def test_relative_links_point_to_files():
    bad = []
    for name in doc_files():
        for target in relative_links(name):
            path = os.path.normpath(os.path.join(REPO, os.path.dirname(name), target))
            if "#" in target:
                bad.append(f"{name}: {target} (links name a file, not an anchor: anchors break when text moves)")
            elif not os.path.isfile(path):
                bad.append(f"{name}: {target} (no such file)")
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(REPO, target)) for target in relative_links("README.md")}
    orphans = [name for name in doc_files()[1:] if os.path.normpath(os.path.join(REPO, name)) not in linked]
    assert not orphans, f"pages under docs/ that README.md does not link: {orphans}"


def test_relative_links_skip_urls_and_code(tmp_path):
    (tmp_path / "README.md").write_text("[a](docs/a.md) [b](https://example.org/b.md) `[c](c.md)`\n"
                                        "```bash\n[d](d.md)\n```\n![e](docs/e.png \"title\")\n")
    assert relative_links("README.md", root=str(tmp_path)) == ["docs/a.md", "docs/e.png"]


def _quickstart_script():
    path = os.path.join(REPO, "scripts", "ci", "readme_quickstart.py")
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
    # The Quickstart runs before any other pass (the other environments are built meanwhile, in the background).
    assert ci.index("scripts/ci/readme_quickstart.py") < ci.index('wait "$build"') < ci.index("python -m pytest")
    text = "intro\n## Quickstart\n\nno commands\n\n## Next\n\n```bash\nnot this one\n```\n"
    with pytest.raises(ValueError, match="has no ```bash block"):
        script.quickstart_lines(text)
    assert script.quickstart_lines(text.replace("no commands", "```bash\nfirst\n\nsecond\n```")) == ["first", "second"]

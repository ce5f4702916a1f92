"""Collective test harness: every test's verdict is agreed across MPI ranks.

The same suite runs serially (``python -m pytest``) and under
``mpiexec -n N python -m pytest``. After each test, the ranks compare
outcomes: if any rank failed, every rank fails with the failing ranks'
messages, so the next test never starts on some ranks while others wait in a
collective. Ranks other than 0 stay quiet unless MPIDOMAIN_TEST_VERBOSE_RANKS=1.
"""

import gc
import json
import os
import sys

import pytest
from mpi4py import MPI

from mpidomain import manager as manager_module
from mpitest import wait_politely

WORLD = MPI.COMM_WORLD


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    # Runs after the terminal plugin created its reporter, before anything is printed.
    if WORLD.Get_rank() != 0 and os.environ.get("MPIDOMAIN_TEST_VERBOSE_RANKS") != "1":
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


# Kinds of test the quick tier leaves out with the ones marked slow (setup.cfg lists them).
_SLOW_KINDS = ("mpi_job", "bench", "fuzz")
# Kinds of test whose outcome does not depend on the world that runs the suite: CI runs them in one pass.
_ONE_WORLD_KINDS = ("mpi_job",)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="mpidomain_all",
                     help="run the whole suite (the slow tests too: jobs, benchmarks, fuzz, compile); without it and "
                          "without -m or named tests, pytest runs the quick tier (-m 'not slow')")


def _quick_tier(config):
    """Whether this run is the quick tier: no --all, no -m, no test named on the command line (-k alone selects
    within the quick tier)."""
    return not (config.getoption("mpidomain_all") or config.option.markexpr or config.option.file_or_dir)


def pytest_report_header(config):
    if _quick_tier(config):
        return "mpidomain: the quick tier (tests marked slow left out); --all runs the whole suite"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    # Static (from the markers alone, and the environment every rank shares), so every rank selects the same tests.
    for item in items:
        if any(item.get_closest_marker(kind) for kind in _SLOW_KINDS) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        if any(item.get_closest_marker(kind) for kind in _ONE_WORLD_KINDS) and not item.get_closest_marker(
                "one_world"):
            item.add_marker(pytest.mark.one_world)
    _RECORD.collected(items)
    if _quick_tier(config):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]


class _Record:
    """What this pass collected and how each selected test ended, written by rank 0 to the file named by
    MPIDOMAIN_TEST_RECORD (one JSON object a line), for CI's check that every test runs in some pass
    (scripts/ci/test_coverage.py)."""

    def __init__(self):
        # Taken out of the environment: a pytest that a test starts in a job of its own records nothing here.
        self.path = os.environ.pop("MPIDOMAIN_TEST_RECORD", None)
        self.rows = []

    def collected(self, items):
        if self.path:
            self.rows += [{"test": item.nodeid, "event": "collected"} for item in items]

    def report(self, report):
        if not self.path:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            xfailed = hasattr(report, "wasxfail")  # it ran, and failed as it says it does
            row = {"test": report.nodeid, "event": "xfailed" if xfailed else report.outcome}
            if report.skipped and not xfailed and isinstance(report.longrepr, tuple):
                row["reason"] = str(report.longrepr[2])
            self.rows.append(row)

    def write(self):
        if self.path and WORLD.Get_rank() == 0:
            with open(self.path, "a") as file:
                file.writelines(json.dumps(row) + "\n" for row in self.rows)


_RECORD = _Record()


def pytest_runtest_logreport(report):
    _RECORD.report(report)


def pytest_sessionfinish(session):
    _RECORD.write()


def _torch_groups_made():
    """How many torch.distributed groups this process has made (0 before torch.distributed is imported)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    return 0 if c10d is None else c10d._world.group_count


def _summary(error):
    if error is None:
        return None
    kind = "skip" if isinstance(error, pytest.skip.Exception) else "fail"
    text = str(error).strip().splitlines()
    return kind, f"{type(error).__name__}: {text[0] if text else ''}"[:500]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    __tracebackhide__ = True
    error = None
    groups = _torch_groups_made()
    try:
        result = yield
    except BaseException as exc:  # the verdict must be shared before re-raising
        error = exc
    if _torch_groups_made() != groups:
        # The test's models (FSDP, DTensor) hold its torch groups in reference cycles; until collected, each
        # gloo group's threads keep waking, which at more ranks than cores slows every later test.
        gc.collect()
    if WORLD.Get_size() > 1:
        wait_politely(WORLD.Ibarrier())
        verdicts = WORLD.allgather(_summary(error))
        failed = [(r, v[1]) for r, v in enumerate(verdicts) if v and v[0] == "fail"]
        skipped = [r for r, v in enumerate(verdicts) if v and v[0] == "skip"]
        if failed and (error is None or _summary(error)[0] == "skip"):
            detail = "\n".join(f"  rank {r}: {m}" for r, m in failed)
            raise AssertionError(f"test failed on other ranks:\n{detail}")
        if not failed and skipped and len(skipped) != len(verdicts):
            raise AssertionError(f"test skipped on ranks {skipped} only; skip decisions must agree")
    if error is not None:
        raise error
    return result


@pytest.fixture(autouse=True)
def _torch_deterministic_mode():
    """Leave torch's deterministic-algorithms mode off after every test, as a fresh process has it: CREDIT's
    ``seed_everything`` (which credit train and rollout call in process, in tests and in session fixtures) turns it
    on for the whole process, and it changes which kernels later tests run (and what they save for backward)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def world():
    """The world communicator the suite runs on."""
    return WORLD


@pytest.fixture
def fresh_manager():
    """Leave no global manager behind: close whatever a test initialised."""
    yield
    current = manager_module.get_domain_parallel_manager()
    if current is not None:
        current.close()


@pytest.fixture(scope="session")
def torch_world():
    """torch.distributed (gloo) started from MPI once per session; yields ``torch.distributed``.

    torch.distributed can be initialised only once per process, so every
    in-process torch test shares this default group; a test that needs a
    fresh one runs a job in a subprocess.
    """
    pytest.importorskip("torch")
    import torch.distributed as dist

    import mpidomain

    if len(set(WORLD.allgather(MPI.Get_processor_name()))) == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the suite's ranks share this machine
    created = mpidomain.init_torch_distributed(backend="gloo")
    yield dist
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(params=["staged", "direct"])
def fake_device_path(request, monkeypatch):
    """Send host arrays down the device code paths: staged through host buffers, or direct to a "CUDA-aware" MPI.

    The one seam is :func:`mpidomain.transport.transport_for`; the GPU machines run the same
    paths on real device memory. Returns the transport's name.
    """
    from mpidomain import transport

    chosen = transport.Transport(request.param)
    monkeypatch.setattr(transport, "transport_for", lambda x: chosen)
    return request.param

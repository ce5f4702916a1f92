"""The command layer: packages checked on every rank, agreed checks, how a command ends, stop signals and
checkpoints (in the suite's own world; tests/test_forecast_jobs.py starts fresh jobs)."""

import os
import signal
import sys

import pytest

from mpidomain import command
from mpidomain.command import Requirement, UsageError, agreed, require, run_command
from mpidomain.preemption import StopSignals, signal_number

MISSING = Requirement("mpidomain_no_such_package", "the test", "pip install mpidomain-no-such-package")


def test_require_names_the_package_what_needs_it_and_the_install_line(world):
    assert require("test", [Requirement("numpy", "the test", "pip install numpy")]) == set()
    with pytest.raises(UsageError) as caught:
        require("test", [Requirement("numpy", "x", "y"), MISSING])
    message = str(caught.value)
    assert message.startswith("mpidomain_no_such_package is needed for the test but does not import here "
                              "(ModuleNotFoundError: No module named 'mpidomain_no_such_package')")
    assert message.endswith("install it: pip install mpidomain-no-such-package")


def test_a_package_whose_own_dependency_is_missing_names_that_one(world, monkeypatch):
    """xarray installed but pandas not: the line says what is missing and installs it, not xarray again."""
    real = command.importlib.import_module

    def without_pandas(name):
        if name == "xarray":
            raise ModuleNotFoundError("No module named 'pandas'", name="pandas")
        return real(name)
    monkeypatch.setattr(command.importlib, "import_module", without_pandas)
    with pytest.raises(UsageError) as caught:
        require("test", [Requirement("xarray", "reading the data", "pip install xarray")])
    assert str(caught.value) == ("xarray is needed for reading the data but does not import here: it needs pandas "
                                 "(ModuleNotFoundError: No module named 'pandas'); install it: pip install pandas")


def test_a_package_older_than_needed_counts_as_missing(world):
    import numpy

    with pytest.raises(UsageError, match=rf"numpy is needed for x but is too old here \(version "
                                         rf"{numpy.__version__}; 999.1 or newer needed\); install it: y"):
        require("test", [Requirement("numpy", "x", "y", minimum="999.1")])
    assert require("test", [Requirement("numpy", "x", "y", minimum="1.0")]) == set()


def test_optional_packages_missing_anywhere_are_missing_everywhere(world, monkeypatch):
    hidden = "mpidomain_test_optional_module"
    if world.rank == world.size - 1:  # one rank lacks it: every rank must fall back alike
        missing = require("test", [], optional=[Requirement(hidden, "comfort", "pip install it")])
    else:
        monkeypatch.setitem(sys.modules, hidden, sys)
        missing = require("test", [], optional=[Requirement(hidden, "comfort", "pip install it")])
    assert missing == {hidden}


def test_a_package_broken_at_import_counts_as_missing(world, tmp_path, monkeypatch):
    folder = tmp_path / f"rank{world.rank}"
    folder.mkdir()
    (folder / "mpidomain_broken_package.py").write_text("raise RuntimeError('built for CUDA, this torch is CPU')\n")
    monkeypatch.syspath_prepend(str(folder))
    with pytest.raises(UsageError, match="mpidomain_broken_package is needed for x but does not import here "
                                         r"\(RuntimeError: built for CUDA, this torch is CPU\); install it: y"):
        require("test", [Requirement("mpidomain_broken_package", "x", "y")])


def test_agreed_turns_one_ranks_failure_into_an_error_on_every_rank(world):
    def work():
        if world.rank == world.size - 1:
            raise OSError(2, "No such file or directory", "/missing")
        return world.rank

    if world.size == 1:
        with pytest.raises(UsageError, match=r"FileNotFoundError: \[Errno 2\] No such file or directory: '/missing'"):
            agreed(command.world(), "test", work)
    else:
        with pytest.raises(ValueError, match=rf"1 of {world.size} ranks rejected the call:\n  rank {world.size - 1}: "
                                             "FileNotFoundError"):
            agreed(command.world(), "test", work)
    assert agreed(command.world(), "test", lambda: 7) == 7


def test_run_command_reports_an_error_every_rank_raised_once_with_status_2(world, capsys):
    def bad_argument():
        agreed(command.world(), "test", lambda: (_ for _ in ()).throw(ValueError("--steps must be >= 1, got 0")))

    assert run_command("test", bad_argument) == 2
    err = capsys.readouterr().err
    if world.rank == 0:
        assert err == "python -m mpidomain test: error: --steps must be >= 1, got 0\n"
    else:
        assert err == ""
    assert run_command("test", lambda: None) == 0
    assert run_command("test", lambda: 3) == 3


def test_a_usage_error_raised_by_every_rank_without_an_agreement_is_reported_once(world, capsys):
    def check():
        raise UsageError("--shape 1,2: expected four extents")

    assert run_command("test", check) == 2
    err = capsys.readouterr().err
    assert err == ("python -m mpidomain test: error: --shape 1,2: expected four extents\n" if world.rank == 0 else "")


def test_signal_names():
    assert signal_number("SIGUSR1") == signal.SIGUSR1 == signal_number("usr1") == signal_number(str(int(signal.SIGUSR1)))
    for bad in ("SIGKILL", "KILL", "SIGFOO", "999"):
        with pytest.raises(ValueError, match="is not a signal a process can catch here; use one of SIGTERM"):
            signal_number(bad)


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_boundary(world):
    comm = world_comm = command.world()
    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignals(comm, ("SIGTERM", "SIGUSR1")) as stop:
        assert stop.names == ("SIGTERM", "SIGUSR1")
        assert not stop.requested() and stop.received is None
        if world_comm.Get_rank() == world_comm.Get_size() - 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # recorded, nothing else: the handler returns
        assert stop.requested()
        last = world_comm.Get_size() - 1
        assert stop.received == f"SIGUSR1 on rank {last}"
    assert signal.getsignal(signal.SIGUSR1) == previous

"""Fresh MPI jobs: import without MPI, the seed's 8-rank layout, info, and abort on error."""

import re
import time

import pytest

from mpitest import open_mpi, run_mpi, run_python


@pytest.mark.mpi_job
def test_import_starts_nothing(world):
    if world.rank == 0:
        code = ("import sys, mpidomain; assert 'mpi4py.MPI' not in sys.modules; assert 'torch' not in sys.modules; "
                "assert 'xarray' not in sys.modules; assert 'zarr' not in sys.modules")
        result = run_python(["-c", code])
        assert result.returncode == 0, result.stderr


@pytest.mark.mpi_job
def test_seed_layout_with_eight_ranks(world):
    if world.rank == 0:
        result = run_mpi(8, ["-m", "mpidomain", "info", "--domain-parallel-size", "2"], timeout=180)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "world size        : 8" in out
        assert "domain groups     : [0,1] [2,3] [4,5] [6,7]" in out
        assert "data-parallel grps: [0,2,4,6] [1,3,5,7]" in out
        assert "tensor-par. grps  : [0] [1] [2] [3] [4] [5] [6] [7]" in out
        assert ("Open MPI mpirun" if open_mpi() else "MPICH Hydra") in out
        rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
        assert len(rows) == 8
        for row in rows:
            rank = int(row[0])
            dp, tp, domain, domain_group, prev, nxt = row[4:10]
            assert (int(dp), int(tp), int(domain)) == (rank // 2, 0, rank % 2)
            assert int(domain_group) == rank // 2
            assert prev == ("-" if rank % 2 == 0 else str(rank - 1))
            assert nxt == ("-" if rank % 2 == 1 else str(rank + 1))


@pytest.mark.mpi_job
def test_info_reports_errors_once(world):
    if world.rank == 0:
        result = run_mpi(4, ["-m", "mpidomain", "info", "-D", "3"], timeout=120)
        assert result.returncode == 2
        assert result.stderr.count("does not divide world_size=4") == 1, result.stderr


def test_info_in_process(world, capsys, fresh_manager):
    from mpidomain.__main__ import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    if world.rank == 0:
        assert f"world size        : {world.size}" in out
    else:
        assert out == ""


ABORT_SCRIPT = """
import time
from mpi4py import MPI
import mpidomain
m = mpidomain.initialize_domain_parallel(MPI.COMM_WORLD.size, 1)
if m.rank == 1:
    raise ZeroDivisionError("rank one fails")
MPI.COMM_WORLD.Barrier()  # the other ranks would wait here forever
"""


@pytest.mark.mpi_job
def test_uncaught_exception_aborts_every_rank(world):
    if world.rank == 0:
        result = run_mpi(3, ["-c", ABORT_SCRIPT], timeout=60)
        assert result.returncode != 0
        assert "[rank 1] ZeroDivisionError: rank one fails" in result.stderr, result.stderr
        assert "aborting all ranks" in result.stderr


@pytest.mark.mpi_job
def test_abort_hook_opt_out(world):
    if world.rank == 0:
        code = ("import sys, mpidomain; mpidomain.initialize_domain_parallel(1, 1); "
                "print(sys.excepthook is sys.__excepthook__)")
        for env, expected in (({}, "False"), ({"MPIDOMAIN_ABORT_ON_ERROR": "0"}, "True")):
            result = run_python(["-c", code], env=env)
            assert result.stdout.strip() == expected, (env, result.stderr)
        code = ("import sys, mpidomain; mpidomain.initialize_domain_parallel(1, 1, abort_on_error=False); "
                "print(sys.excepthook is sys.__excepthook__)")
        assert run_python(["-c", code]).stdout.strip() == "True"


EXITS_SCRIPT = """
import sys
from mpi4py import MPI
import mpidomain
mode, comm = sys.argv[1], MPI.COMM_WORLD
if mode == "before" and comm.rank == 1:
    raise ValueError("rank one fails before the manager exists")
mpidomain.initialize_domain_parallel(comm.size, comm.size)
if comm.rank == 1 and mode == "exit":
    sys.exit(3)
if comm.rank == 1 and mode == "after":
    raise ValueError("rank one fails after initialisation")
comm.Barrier()  # rank 0 would wait here forever
"""


@pytest.mark.parametrize("mode, message", [
    ("before", "ValueError: rank one fails before the manager exists"),
    ("exit", None),
    ("after", "[rank 1] ValueError: rank one fails after initialisation"),
])
@pytest.mark.mpi_job
def test_python_m_mpi4py_ends_exits_the_library_cannot_see(world, tmp_path_factory, mode, message):
    # docs/manager.md's errors section: under `python -m mpi4py`, an exception before the manager exists and
    # sys.exit(3) on one rank end the job too; after initialisation our hook still prints once and aborts.
    if world.rank == 0:
        script = tmp_path_factory.mktemp("exits") / "train.py"
        script.write_text(EXITS_SCRIPT)
        started = time.monotonic()
        result = run_mpi(2, ["-m", "mpi4py", str(script), mode], timeout=60)
        assert result.returncode != 0, result.stderr  # the status itself is the launcher's (MPICH: 1, 3)
        assert time.monotonic() - started < 30
        if message is not None:
            assert result.stderr.count(message) == 1, result.stderr


SKIPPED_CALL_SCRIPT = """
import time
import numpy as np
from mpi4py import MPI
import mpidomain
comm = MPI.COMM_WORLD
caught = __import__("sys").argv[1] == "caught"
mpidomain.initialize_domain_parallel(comm.size, comm.size, abort_on_error=not caught)
x = np.ones((4, 3))
for step in range(2):
    mpidomain.halo_exchange(x, 1, 0)
if comm.rank != 1:  # rank 1 skips the last exchange and ends: nothing follows for the others to meet
    started = time.monotonic()
    try:
        mpidomain.halo_exchange(x, 1, 0)
    except RuntimeError as error:
        if not caught:
            raise
        print(f"RANK {comm.rank} AFTER {time.monotonic() - started:.1f} S: {error}", flush=True)
    try:
        mpidomain.allreduce(x)
    except RuntimeError as error:
        print(f"RANK {comm.rank} THEN: {error}", flush=True)
    time.sleep(1 if comm.rank == 0 else 60)  # both ranks print before rank 0 ends the job
    comm.Abort(4)
"""


@pytest.mark.parametrize("mode", ["uncaught", "caught"])
@pytest.mark.mpi_job
def test_a_skipped_last_call_times_out_instead_of_hanging(world, tmp_path_factory, mode):
    # Nothing after the skipped call can meet the waiting ranks' agreement: MPIDOMAIN_TIMEOUT bounds the wait.
    if world.rank == 0:
        script = tmp_path_factory.mktemp("skipped") / "train.py"
        script.write_text(SKIPPED_CALL_SCRIPT)
        started = time.monotonic()
        result = run_mpi(3, [str(script), mode], timeout=90, env={"MPIDOMAIN_TIMEOUT": "2"})
        elapsed = time.monotonic() - started
        assert result.returncode != 0, result.stderr
        assert elapsed < 45, (elapsed, result.stderr)
        waited = "waited 2 s for the other ranks (MPIDOMAIN_TIMEOUT=2); a rank skipped this call, ended"
        if mode == "uncaught":
            assert waited in result.stderr and "aborting all ranks" in result.stderr, result.stderr
        else:
            for rank in (0, 2):
                assert re.search(rf"RANK {rank} AFTER [23]\.\d S: halo_exchange: rank {rank} of domain group 0 \(ranks 0-2\) "
                                 rf"{re.escape(waited)}",
                                 result.stdout), result.stdout + result.stderr
                assert f"RANK {rank} THEN: allreduce: an earlier mpidomain call on this group timed out" in result.stdout


@pytest.mark.parametrize("setting, expected", [("0", None), ("none", None), ("2.5", 2.5), (None, 600.0)])
def test_timeout_setting(monkeypatch, setting, expected):
    from mpidomain._waits import timeout_seconds

    if setting is None:
        monkeypatch.delenv("MPIDOMAIN_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("MPIDOMAIN_TIMEOUT", setting)
    assert timeout_seconds() == expected


@pytest.mark.parametrize("setting", ["soon", "-1"])
def test_timeout_setting_mistakes(monkeypatch, setting):
    from mpidomain._waits import timeout_seconds

    monkeypatch.setenv("MPIDOMAIN_TIMEOUT", setting)
    with pytest.raises(ValueError, match=rf"MPIDOMAIN_TIMEOUT must be .*got '{re.escape(setting)}'"):
        timeout_seconds()

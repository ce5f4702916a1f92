"""write_tile when something fails: a write one rank cannot make, a job killed at every point of a call.

A failed call leaves the store as it was (the steps it held, nothing more); a
store a killed job left holds only whole steps and the next write_tile
completes it or refuses with a clear error. The kill points are reached in
this process (a test-only hook raises where the job would die) and in jobs of
their own (``os._exit`` at the hook; SIGKILL of one rank of four in the middle
of appends).
"""

import inspect
import os
import pathlib
import shutil
import signal
import threading
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

xr = pytest.importorskip("xarray")
zarr = pytest.importorskip("zarr")

import mpitest  # noqa: E402
from test_write import GRIDS, grid_of, layouts, make_dataset, opened, shared, tile_of  # noqa: E402,F401 (fixtures)

from mpidomain import DomainParallelManager, balanced_split  # noqa: E402
from mpidomain.data import write_tile  # noqa: E402

# xarray's to_zarr writes consolidated metadata by default; zarr warns that it is not in the v3 specification.
pytestmark = pytest.mark.filterwarnings("ignore:Consolidated metadata is currently not part")


def blocked_chunk(path, manager, step, shape):
    """Put a folder where ``t``'s chunk of ``step``, level chunk 0, the last latitude chunk and the first longitude
    chunk must go: the rank that writes it (the last tile row's first) cannot replace it, the others write theirs.
    Return the folder and that rank's domain rank."""
    chunk = zarr.open_array(path, path="t", mode="r").chunks[2]
    last = -(-shape[0] // chunk) - 1
    blocker = os.path.join(path, "t", "c", str(step), "0", str(last), "0")
    os.makedirs(os.path.join(blocker, "in the way"))
    grid = grid_of(manager)
    counts, offsets = balanced_split(shape[0], grid[0])
    row = max(i for i in range(grid[0]) if offsets[i] <= last * chunk)
    return blocker, row * grid[1]


def test_a_failed_write_leaves_the_store_as_it_was(world, layouts, shared):
    """One rank cannot write its chunks of an appended step: the same error on every rank, the store still holds its
    two steps and nothing else (read with and without consolidated metadata), and the retry appends the step once."""
    shape = GRIDS[0]
    data = make_dataset(shape, steps=3, seed=20)
    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-blocked.zarr")
        if world.rank == 0:
            data.isel(time=slice(0, 2)).to_zarr(path, encoding={"time": {"chunks": (1,)}, "t": {"chunks": (1, 2, 5, 7)},
                                                                 "sp": {"chunks": (1, 5, 7)}})
        world.Barrier()
        blocker, writer = blocked_chunk(path, manager, 2, shape) if world.rank == 0 else (None, None)
        writer = world.bcast(writer)
        before = {c: opened(path, c) for c in (True, False)} if world.rank == 0 else None
        try:
            write_tile(tile_of(data.isel(time=[2]), manager), path, manager, append_dim="time")
            raised = None
        except Exception as error:  # noqa: BLE001 - any error, as long as every rank raises it
            raised = (type(error).__name__, str(error))
        messages = world.allgather(raised)
        if world.rank == 0:
            named = manager.domain_parallel_size == 1 or f"rank {writer}" in messages[0][1] if messages[0] else False
            if len(set(messages)) != 1 or messages[0] is None or not named or "as it was" not in messages[0][1]:
                problems.append(f"{label}: expected one error naming rank {writer}, got {messages}")
            for consolidated in (True, False):
                if not opened(path, consolidated).identical(before[consolidated]):
                    problems.append(f"{label}: the store changed (consolidated={consolidated})")
            shutil.rmtree(blocker)
        world.Barrier()
        write_tile(tile_of(data.isel(time=[2]), manager), path, manager, append_dim="time")
        if world.rank == 0:
            for consolidated in (True, False):
                got = opened(path, consolidated)
                if not got.identical(data):
                    problems.append(f"{label}: after the retry (consolidated={consolidated}) the store holds times "
                                    f"{got.time.values}, not the three steps written")
    assert not problems, problems


class Killed(BaseException):
    """Where the test's hook stops a call as a kill would: no handler of write_tile's runs (it catches Exception)."""


def step_data(step, shape=(9, 12)):
    """Time step ``step`` of a small dataset, the same on every rank and in every job: t (time, level, lat, lon)
    float32, sp (time, lat, lon) float64, land (lat, lon) int16."""
    rng = np.random.default_rng(100 + step)
    H, W = shape
    return xr.Dataset(
        {"t": (("time", "level", "latitude", "longitude"), rng.standard_normal((1, 2, H, W)).astype(np.float32)),
         "sp": (("time", "latitude", "longitude"), rng.standard_normal((1, H, W))),
         "land": (("latitude", "longitude"), (np.arange(H * W) % 3).reshape(H, W).astype(np.int16))},
        coords={"time": np.datetime64("2000-01-01T00", "ns") + np.array([step]) * np.timedelta64(6, "h"),
                "level": [500, 850], "latitude": np.linspace(90, -90, H), "longitude": np.arange(W) * 30.0})


def steps_data(first, stop):
    """Steps ``first`` to ``stop - 1`` of :func:`step_data`, one dataset."""
    return xr.concat([step_data(k) for k in range(first, stop)], "time", data_vars="minimal")


def lengths(path):
    """Each array's length along time, from its own metadata: {name: length}."""
    group = zarr.open_group(path, mode="r", use_consolidated=False)
    return {name: array.shape[0] for name, array in group.arrays() if array.metadata.dimension_names[0] == "time"}


def whole_steps(path, steps, consolidated, killed=False):
    """Problems of the store at ``path`` read as a reader would: it must hold steps 0 to ``steps - 1`` exactly, or
    (``killed`` inside the commit, read without consolidated metadata) refuse to open because its arrays' lengths
    disagree, with the time coordinate at ``steps`` and no array shorter."""
    try:
        got = opened(path, consolidated)
    except ValueError as error:
        if killed and not consolidated and "conflicting sizes" in str(error):
            found = lengths(path)
            if found["time"] == steps and min(found.values()) == steps:
                return []
            return [f"lengths {found} after a kill, not {steps} committed and more beyond"]
        return [f"the store does not open (consolidated={consolidated}): {error}"]
    want = steps_data(0, steps)
    if not got.drop_vars("land").identical(want.drop_vars("land")):
        return [f"consolidated={consolidated}: times {got.time.values}, not the {steps} whole steps written"]
    return []


# Where the hook stops the second of two appends (steps 0-2 written, step 3 appended; time chunks of 2, so step 3
# rewrites the chunk that holds step 2): (what it stops, at which call of it, the steps a reader sees after: through
# the consolidated metadata, through each array's own).
KILL_POINTS = {
    "a chunk rename": ("rename", 3, 3, 3),  # the third chunk file moved into place: sp's that holds steps 2 and 3
    "before the commit": ("resize", 1, 3, 3),
    "between two arrays' commits": ("resize", 2, 3, 3),  # sp committed, t and time not
    "before the coordinate's commit": ("resize", 3, 3, 3),  # sp and t committed, time not
    "before the consolidated metadata": ("consolidate", 1, 3, 4),  # every array committed, the consolidated copy not
}


def kill_hook(monkeypatch, what, at):
    """Make the ``at``-th call of ``what`` raise :class:`Killed` before it acts (chunk renames: after the temporary
    file is written, before it replaces the chunk)."""
    calls = []

    def stop(original, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise Killed(what)
        return original(*args, **kwargs)

    if what == "rename":
        original = pathlib.Path.replace
        monkeypatch.setattr(pathlib.Path, "replace", lambda self, target: stop(original, self, target)
                            if "/c/" in str(target) else original(self, target))
    elif what == "resize":
        original = zarr.Array.resize
        monkeypatch.setattr(zarr.Array, "resize", lambda self, shape: stop(original, self, shape))
    elif what == "consolidate":
        original = zarr.consolidate_metadata
        monkeypatch.setattr(zarr, "consolidate_metadata", lambda *a, **k: stop(original, *a, **k))
    elif what == "root":
        original = zarr.open_group
        monkeypatch.setattr(zarr, "open_group", lambda *a, **k: stop(original, *a, **k) if k.get("mode") == "a"
                            else original(*a, **k))


@pytest.fixture
def alone():
    """A manager of this rank alone (D = 1 over MPI.COMM_SELF): each rank runs its own killed calls."""
    with DomainParallelManager(1, 1, comm=MPI.COMM_SELF) as manager:
        yield manager


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_kill_inside_an_append_leaves_whole_steps(alone, tmp_path, monkeypatch, point):
    """Stopped at each point of an append to a consolidated store with time chunks of 2, the store holds whole steps
    (read either way), and the next write_tile completes it: the step again where it was not committed, the next
    step where it was (the same step again is then refused, naming its time)."""
    what, at, seen, own = KILL_POINTS[point]
    path = str(tmp_path / "store.zarr")
    steps_data(0, 2).to_zarr(path, encoding={"time": {"chunks": (2,)}, "t": {"chunks": (2, 2, 5, 12)},
                                             "sp": {"chunks": (2, 5, 12)}})
    write_tile(step_data(2), path, alone, append_dim="time")
    with monkeypatch.context() as patched:
        kill_hook(patched, what, at)
        with pytest.raises(Killed):
            write_tile(step_data(3), path, alone, append_dim="time")
    problems = whole_steps(path, seen, True) + whole_steps(path, own, False, killed=True)
    committed = lengths(path)["time"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if committed == 4:
            with pytest.raises(ValueError, match="2000-01-01T18:00"):
                write_tile(step_data(3), path, alone, append_dim="time")
        write_tile(steps_data(committed, 5), path, alone, append_dim="time")
    repaired = [str(w.message) for w in caught if "never committed" in str(w.message)]
    if max(lengths(path).values()) != 5 or (point.startswith("between") or "coordinate" in point) != bool(repaired):
        problems.append(f"warnings of a repair: {repaired}")
    problems += whole_steps(path, 5, True) + whole_steps(path, 5, False)
    assert not problems, problems


def test_a_kill_before_a_new_store_is_committed(alone, tmp_path, monkeypatch):
    """Stopped before its group's zarr.json, a new store does not open; the same first write_tile again makes it,
    and one of other variables refuses, naming the arrays left."""
    path = str(tmp_path / "new.zarr")
    with monkeypatch.context() as patched:
        kill_hook(patched, "root", 1)
        with pytest.raises(Killed):
            write_tile(steps_data(0, 2), path, alone, append_dim="time")
    with pytest.raises((FileNotFoundError, zarr.errors.GroupNotFoundError)):
        xr.open_zarr(path, consolidated=False)
    with pytest.raises(ValueError, match=r"holds the Zarr arrays \['land', 'latitude', 'level', 'longitude', 'sp', "
                                         r"'t', 'time'\] but no group zarr.json"):
        write_tile(steps_data(0, 2).drop_vars("land"), path, alone, append_dim="time")
    write_tile(steps_data(0, 2), path, alone, append_dim="time")
    write_tile(steps_data(2, 3), path, alone, append_dim="time")
    assert not whole_steps(path, 3, False)


def test_committed_extent_is_the_coordinates():
    """The rule (pure): the coordinate's length where the dim has one (committed last), the shortest array's where
    it has none; an array shorter than the coordinate raises, naming every array's length."""
    from mpidomain.data.write_commit import committed_extent

    assert committed_extent("time", {"t": 5, "sp": 4, "time": 4}, "time", "s.zarr") == 4
    assert committed_extent("time", {"t": 5, "sp": 4}, None, "s.zarr") == 4
    with pytest.raises(ValueError, match=r"shorter along 'time' than its coordinate 'time' \(sp: 3, t: 5, time: 4; "
                                         r"shorter: \['sp'\]\).*restore it, or write to a new path"):
        committed_extent("time", {"t": 5, "sp": 3, "time": 4}, "time", "s.zarr")


def test_a_store_no_write_tile_leaves_is_refused_alike(world, layouts, shared):
    """A time coordinate longer than the arrays (a state no write_tile leaves): the same error on every rank, naming
    the arrays and their lengths, and the store unchanged byte for byte."""
    from test_write import digest_of

    problems = []
    for label, manager in layouts:
        path = os.path.join(shared, f"{label}-foreign.zarr")
        write_tile(tile_of(steps_data(0, 2), manager), path, manager, append_dim="time")
        if world.rank == 0:
            zarr.open_array(os.path.join(path, "time"), mode="r+").resize((3,))
        world.Barrier()
        before = digest_of(path) if world.rank == 0 else None
        try:
            write_tile(tile_of(step_data(2), manager), path, manager, append_dim="time")
            raised = None
        except ValueError as error:
            raised = str(error)
        messages = world.allgather(raised)
        if world.rank == 0:
            if len(set(messages)) != 1 or not messages[0] or "(sp: 2, t: 2, time: 3; shorter: ['sp', 't'])" \
                    not in messages[0]:
                problems.append(f"{label}: {messages}")
            if digest_of(path) != before:
                problems.append(f"{label}: the store changed")
    assert not problems, problems


JOB = '''
"""A write_tile job of tests/test_write_faults.py: python job.py MODE PATH [STOP] (4 ranks: 2 x 2 tiles, else
slabs)."""
import os
import sys

import numpy as np
import xarray as xr
import zarr
from mpi4py import MPI

from mpidomain import DomainParallelManager
from mpidomain.data import select_tile, write_tile

# step_data, from the test file

world = MPI.COMM_WORLD
mode, path = sys.argv[1], sys.argv[2]
manager = (DomainParallelManager(4, (2, 2), shard_dim=(-2, -1)) if world.size == 4 else
           DomainParallelManager(world.size, world.size))


def append(first, stop):
    for step in range(first, stop):
        write_tile(select_tile(step_data(step), manager).load(), path, manager, append_dim="time",
                   chunks={"time": 3, "latitude": 4, "longitude": 5})


def committed():
    """The steps the store holds: its time coordinate's length (0 where no store is committed yet)."""
    return zarr.open_array(os.path.join(path, "time"), mode="r").shape[0] if os.path.exists(
        os.path.join(path, "zarr.json")) else 0


if mode == "kill":  # KILL_AT: "between" two arrays' commits of the third step's append; "new" at a new store's chunk
    at = os.environ["KILL_AT"]
    if at == "between":
        append(0, 2)
    if manager.domain_rank == 0:  # the test's hook: this rank dies there
        if at == "between":
            resize = zarr.Array.resize
            zarr.Array.resize = lambda self, shape: (resize(self, shape), os._exit(7))
        else:
            import pathlib
            replace = pathlib.Path.replace
            pathlib.Path.replace = lambda self, target: os._exit(7) if "/t/c/" in str(target) else replace(self, target)
    append(0, 2) if at == "new" else append(2, 3)
elif mode == "resume":  # up to step sys.argv[3] (default 4), one call per step, from the steps the store holds
    append(committed(), int(sys.argv[3]) if len(sys.argv) > 3 else 4)
elif mode == "loop":  # appends until killed; each rank's pid, and rank 0's progress, in files beside the store
    with open(f"{path}.pid{world.rank}", "w") as handle:
        handle.write(str(os.getpid()))
    append(0, 2)
    if world.rank == 0:
        zarr.consolidate_metadata(path)
    for step in range(2, 500):
        append(step, step + 1)
        if world.rank == 0:
            with open(f"{path}.progress.partial", "w") as handle:
                handle.write(str(step + 1))
            os.replace(f"{path}.progress.partial", f"{path}.progress")
manager.close()
'''


def job_program(tmp_path):
    """The job's program, with step_data, written to ``tmp_path``; its path."""
    source = JOB.replace("# step_data, from the test file\n", inspect.getsource(step_data))
    program = tmp_path / "write_job.py"
    program.write_text(source)
    return str(program)


@pytest.mark.mpi_job
@pytest.mark.parametrize("at", ["between", "new"])
def test_a_killed_job_leaves_whole_steps(world, tmp_path, at):
    """Domain rank 0 of a 2-rank job dies between two arrays' commits of an append, or as it writes its first chunk
    of a new store's t: the job ends non-zero, the store holds whole steps (or is no store yet), and a rerun
    appends the rest."""
    result = None
    if world.rank == 0:
        program, path = job_program(tmp_path), str(tmp_path / "killed.zarr")
        killed = mpitest.run_mpi(2, [program, "kill", path], timeout=120, env={"KILL_AT": at})
        problems = [] if killed.returncode != 0 else [f"the killed job ended with 0: {killed.stderr[-2000:]}"]
        if at == "between":
            problems += whole_steps(path, 2, False, killed=True)
        elif os.path.exists(os.path.join(path, "zarr.json")):
            problems.append("a new store was committed though its chunks were not all written")
        resumed = mpitest.run_mpi(2, [program, "resume", path], timeout=120)
        if resumed.returncode != 0:
            problems.append(f"the rerun failed: {resumed.stderr[-3000:]}")
        else:
            problems += whole_steps(path, 4, False)
        result = problems
    problems = mpitest.share(world, result)
    assert not problems, problems


@pytest.mark.mpi_job
def test_sigkill_of_one_rank_in_the_middle_of_appends(world, tmp_path):
    """SIGKILL of one rank of a 4-rank job (2 x 2 tiles, chunks straddling them, time chunks of 3, consolidated
    metadata) that appends step after step: the job ends non-zero, the store holds whole steps, each equal to what was
    appended (through its consolidated metadata at most one step fewer), and a 2-rank rerun appends the rest."""
    result = None
    if world.rank == 0:
        program, path = job_program(tmp_path), str(tmp_path / "appended.zarr")
        killed_at = []

        def kill_one_rank():
            deadline = time.monotonic() + 110
            while time.monotonic() < deadline:
                try:
                    with open(f"{path}.progress") as handle:
                        progress = int(handle.read())
                    with open(f"{path}.pid2") as handle:
                        pid = int(handle.read())
                except (OSError, ValueError):
                    progress = 0
                if progress >= 6:
                    os.kill(pid, signal.SIGKILL)
                    killed_at.append((time.monotonic(), progress))
                    return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_one_rank, daemon=True)
        killer.start()
        job = mpitest.run_mpi(4, [program, "loop", path], timeout=120)
        ended = time.monotonic()
        killer.join()
        problems = [] if killed_at else ["the job never reached step 6"]
        if job.returncode == 0:
            problems.append("the job ended with 0 though a rank was killed")
        steps = lengths(path)["time"]
        with open(f"{path}.progress") as handle:
            reported = int(handle.read())  # the steps rank 0 saw done; it may have committed the next
        if not reported <= steps <= reported + 1:
            problems.append(f"{steps} steps committed, rank 0 reported {reported} done")
        problems += whole_steps(path, steps, False, killed=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            behind = steps - xr.open_zarr(path).sizes["time"]
        problems += whole_steps(path, steps - behind, True) if behind in (0, 1) else [f"consolidated: {behind} behind"]
        resumed = mpitest.run_mpi(2, [program, "resume", path, str(steps + 2)], timeout=120)  # two more steps
        if resumed.returncode != 0:
            problems.append(f"the rerun failed: {resumed.stderr[-3000:]}")
        else:
            problems += whole_steps(path, steps + 2, False) + whole_steps(path, steps + 2, True)
        result = (problems, None if not killed_at else round(ended - killed_at[0][0], 2))
    problems, seconds = mpitest.share(world, result)
    print(f"after the SIGKILL every rank ended within {seconds} s")
    assert not problems, problems

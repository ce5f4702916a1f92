"""``python -m mpidomain forecast`` in fresh jobs: faults on one rank, kills, the stop signal, missing packages, full
or read-only output folders, and every option with a bad value.

Each job has a fixed size (4 ranks; 2 for the failures, kills and signals), so these run once in CI (``mpi_job``
implies ``one_world``). A fault is injected by ``tests/fault_driver.py`` on one rank at one stage; every rank must
end within :data:`ENDS_WITHIN` seconds of it (the library's own wait timeout is 600 s), and the rerun with ``--resume auto`` must end as the uninterrupted run
did: the same losses, and a forecast store equal array for array.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from mpitest import (REPO, hiding_env, launcher_env, mpiexec_path, open_mpi, open_mpi_env, program_lines, run_mpi,
                     share)

torch = pytest.importorskip("torch")
xr = pytest.importorskip("xarray")
pytest.importorskip("zarr")

pytestmark = pytest.mark.mpi_job

# The kill and signal jobs and their reference: two ranks show "every rank ends" and "every rank stops after the
# same step" as four do, at half the cost
KILLS_RANKS = 2
ENDS_WITHIN = 20.0  # seconds from the fault until every rank has ended (3 s for a failure alone, then MPI_Abort)
SMALL = ["--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "6", "--rollout", "3", "--checkpoint-every",
         "2"]
DRIVER = os.path.join(REPO, "tests", "fault_driver.py")


def forecast(out, *args, fault=None, launcher="mpiexec", env=None, timeout=240, ranks=4):
    """Run the forecast on ``ranks`` ranks (through the fault driver with ``fault``); return (status, stdout, stderr,
    seconds, the fault's time or None)."""
    program = [DRIVER, fault] if fault else ["-m", "mpidomain"]
    args = [*program, "forecast", *SMALL, "--out", str(out), *args]
    began = time.time()
    if launcher == "srun":  # Slurm's own kill of the other tasks when one exits badly (-K), as job scripts set it
        done = subprocess.run(["srun", "-n", str(ranks), "-K", "--mpi=pmi2", sys.executable, *args],
                              env=launcher_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    else:
        done = run_mpi(ranks, args, timeout=timeout, env=env)
    ended = time.time()
    faulted = re.search(r"FAULT \S+ ([\d.]+)", done.stderr)
    return done.returncode, done.stdout, done.stderr, ended - began, float(faulted.group(1)) if faulted else None, ended


def outcome(out):
    """The losses of ``out``'s newest checkpoint and its forecast store's arrays (None where missing)."""
    losses = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["losses"]
    path = os.path.join(out, "forecast.zarr")
    arrays = None
    if os.path.exists(path):
        store = xr.open_zarr(path, consolidated=False, chunks=None).load()
        arrays = {name: store[name].values for name in [*store.data_vars, "time"]}
    return losses, arrays


def same(got, want):
    losses, arrays = got
    return losses == want[0] and arrays is not None and sorted(arrays) == sorted(want[1]) and all(
        np.array_equal(arrays[name], want[1][name]) for name in arrays)


@pytest.fixture
def tmp_path(tmp_path, world):
    """Rank 0's temporary folder, on every rank: rank 0 starts the jobs, and every rank checks what they printed,
    which names it (each rank's own pytest has its own temporary folders)."""
    return pathlib.Path(share(world, str(tmp_path) if world.rank == 0 else None))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's losses and forecast store at 2 ranks, as the kill and signal jobs run (computed on
    rank 0)."""
    from mpi4py import MPI

    world, result = MPI.COMM_WORLD, None
    if world.rank == 0:
        out = tmp_path_factory.mktemp("reference")
        status, _, stderr, *_ = forecast(out, ranks=KILLS_RANKS)
        result = outcome(str(out)) if status == 0 else stderr[-3000:]
    result = share(world, result)
    assert isinstance(result, tuple), result
    return result


def test_a_failure_writing_a_checkpoint_is_one_line_on_every_rank(world, tmp_path):
    result = None
    if world.rank == 0:
        result = forecast(tmp_path / "run", fault="raise:checkpoint:0")
    status, stdout, stderr, seconds, faulted, ended = share(world, result)
    assert status == 1, stderr[-3000:]
    assert re.search(r"^python -m mpidomain forecast: error: could not write the checkpoint \S+checkpoint-000002.pt "
                     r"\(RuntimeError: injected failure at checkpoint\); no checkpoint yet$", stderr, re.M), stderr[-3000:]
    assert ended - faulted < ENDS_WITHIN


@pytest.mark.parametrize("stage, rank, ranks", [("setup", 1, 2), ("data", 1, 2), ("step", 1, 2), ("forecast", 1, 2),
                                                ("write", 1, 4), ("plot", 0, 2), ("scores", 1, 2)])
def test_a_failure_on_one_rank_ends_every_rank_at_once(world, tmp_path, stage, rank, ranks):
    """A RuntimeError on one rank at each stage (2-rank jobs: two ranks show "every rank" as four do, at half the
    start-up; a 4-rank job where a rank's tile spans two chunks of a step, for the failure in mid-write): one line
    naming it, every rank ended at once."""
    result = None
    if world.rank == 0:
        extra = ["--plot", str(tmp_path / "forecast.png")] if stage == "plot" else []
        result = forecast(tmp_path / "run", *extra, fault=f"raise:{stage}:{rank}", ranks=ranks)
    status, stdout, stderr, seconds, faulted, ended = share(world, result)
    assert faulted is not None, stderr[-3000:]
    assert status == 1, (status, stderr[-3000:])
    # One rank's message (a failure a group settled, as a write's, names the failing rank within it).
    line = re.search(r"^python -m mpidomain forecast: error on rank \d+: RuntimeError: (.*)$", stderr, re.M)
    assert line and f"injected failure at {stage}" in line.group(1) and (
        line.group(0).startswith(f"python -m mpidomain forecast: error on rank {rank}:") or f"rank {rank}:" in
        line.group(1)), stderr[-3000:]
    assert "ending the job on every rank" in stderr
    assert ended - faulted < ENDS_WITHIN, f"ended {ended - faulted:.1f} s after the fault"


@pytest.mark.parametrize("fault", ["kill:step:1:4", "kill:checkpoint:0:2", "kill:write:1:2"],
                         ids=["in-training", "writing-a-checkpoint", "writing-a-forecast-step"])
def test_a_killed_rank_ends_the_job_and_resume_auto_completes_it(world, tmp_path, reference, fault):
    result = None
    if world.rank == 0:
        killed = forecast(tmp_path / "run", fault=fault, ranks=KILLS_RANKS)
        partial = sorted(os.listdir(tmp_path / "run"))
        rerun = forecast(tmp_path / "run", "--resume", "auto", ranks=KILLS_RANKS)
        result = killed, partial, rerun, outcome(str(tmp_path / "run")) if rerun[0] == 0 else None
    (status, _, stderr, _, faulted, ended), partial, rerun, got = share(world, result)
    assert faulted is not None and status != 0, stderr[-3000:]
    assert ended - faulted < ENDS_WITHIN, f"ended {ended - faulted:.1f} s after the kill"
    if "checkpoint" in fault:
        assert "checkpoint-000004.pt.partial" in partial and "checkpoint-000004.pt" not in partial, partial
    assert rerun[0] == 0, rerun[2][-3000:]
    if "checkpoint" in fault:
        assert re.search(r"--resume auto skips \S+checkpoint-000004.pt.partial: partial", rerun[1]), rerun[1]
    assert same(got, reference), (got[0], reference[0])


@pytest.mark.parametrize("fault, line, files", [
    ("signal:setup:1", r"stopped by SIGUSR1 on rank 1 before training: nothing trained, nothing saved",
     ["era5-synthetic.zarr"]),
    ("signal:step:1:3", r"stopped by SIGUSR1 on rank 1 after step 3: checkpoint \S+checkpoint-000003.pt; continue with "
                        r"the same command and --resume auto \(--out \S+\)", ["checkpoint-000002.pt", "checkpoint-000003.pt",
                                                                 "checkpoint.pt", "era5-synthetic.zarr"]),
    ("signal:forecast:1:1", r"stopped by SIGUSR1 on rank 1 during the forecast, after lead 1: \S+forecast.zarr holds 1 "
                            r"of 3 steps; complete it with the same command and --resume auto",
     ["checkpoint-000002.pt", "checkpoint-000004.pt", "checkpoint-000006.pt", "checkpoint.pt", "era5-synthetic.zarr",
      "forecast.zarr"]),
], ids=["before-training", "in-training", "in-the-forecast"])
def test_a_signal_on_one_rank_stops_cleanly_and_the_run_resumes(world, tmp_path, reference, fault, line, files):
    result = None
    if world.rank == 0:
        stopped = forecast(tmp_path / "run", fault=fault, ranks=KILLS_RANKS)
        left = sorted(os.listdir(tmp_path / "run"))
        rerun = forecast(tmp_path / "run", "--resume", "auto", ranks=KILLS_RANKS)
        result = stopped, left, rerun, outcome(str(tmp_path / "run")) if rerun[0] == 0 else None
    (status, stdout, stderr, *_), left, rerun, got = share(world, result)
    assert status == 0, stderr[-3000:]
    assert re.search(f"^{line}$", stdout, re.M), stdout
    assert stdout.strip().splitlines()[-1].startswith("forecast stopped: cnn float32 (eager)")
    assert left == files
    assert rerun[0] == 0, rerun[2][-3000:]
    assert same(got, reference)


def test_a_package_missing_on_one_rank_only(world, tmp_path):
    """A partial install: matplotlib hidden from rank 3 alone. Every rank ends at once with one line naming it."""
    result = None
    if world.rank == 0:
        hidden = hiding_env(["matplotlib"])
        plain = [sys.executable, "-m", "mpidomain", "forecast", *SMALL, "--out", str(tmp_path / "run"), "--plot",
                 str(tmp_path / "f.png")]
        if open_mpi():
            command = [mpiexec_path(), "--oversubscribe", "-n", "3", *plain, ":", "-n", "1",
                       *[a for k, v in hidden.items() for a in ("-x", f"{k}={v}")], *plain]
        else:
            command = [mpiexec_path(), "-n", "3", *plain, ":", "-n", "1",
                       *[a for k, v in hidden.items() for a in ("-env", k, v)], *plain]
        began = time.time()
        done = subprocess.run(command, env=launcher_env(open_mpi_env()), capture_output=True, text=True, timeout=240)
        result = done.returncode, done.stderr, time.time() - began
    status, stderr, seconds = share(world, result)
    assert status == 2, stderr[-3000:]
    assert program_lines(stderr) == ["python -m mpidomain forecast: error: 1 of 4 ranks rejected the call: rank 3: "
                                     "matplotlib is needed for --plot " + str(tmp_path / "f.png") + " but does not "
                                     "import here (ModuleNotFoundError: No module named 'matplotlib'); install it: "
                                     "pip install matplotlib"], stderr
    assert seconds < 60


@pytest.mark.parametrize("hide, broken, args, message", [
    (["matplotlib"], [], ["--plot", "PNG"], "matplotlib is needed for --plot PNG but does not import here "
                                            "(ModuleNotFoundError: No module named 'matplotlib'); install it: "
                                            "pip install matplotlib"),
    ([], ["matplotlib"], ["--plot", "PNG"], "matplotlib is needed for --plot PNG but does not import here "
                                            "(RuntimeError: matplotlib was built for another torch"),
    (["zarr"], [], [], "zarr is needed for python -m mpidomain forecast (reading and writing stores) but does not "
                       "import here (ModuleNotFoundError: No module named 'zarr'); install it: pip install 'zarr>=3.1.5'"),
    (["xarray"], [], [], "xarray is needed for python -m mpidomain forecast (reading and writing stores)"),
    (["torch"], [], [], "torch is needed for python -m mpidomain forecast (the model) but does not import here"),
], ids=["matplotlib", "matplotlib-broken", "zarr", "xarray", "torch"])
def test_a_missing_package_is_one_line_on_every_rank_within_seconds(world, tmp_path, hide, broken, args, message):
    result = None
    if world.rank == 0:
        args = [str(tmp_path / "forecast.png") if a == "PNG" else a for a in args]
        result = forecast(tmp_path / "run", *args, env=hiding_env(hide, broken))
    status, stdout, stderr, seconds, *_ = share(world, result)
    message = message.replace("PNG", str(tmp_path / "forecast.png"))
    assert status == 2, stderr[-3000:]
    assert program_lines(stderr) == [f"python -m mpidomain forecast: error: {program_lines(stderr)[0].split(': error: ')[1]}"]
    assert message in stderr, stderr
    assert "Traceback" not in stderr
    assert seconds < 60, f"{seconds:.0f} s"
    assert not os.path.exists(tmp_path / "run" / "checkpoint.pt")


def test_without_tqdm_progress_comes_as_plain_lines(world, tmp_path):
    result = None
    if world.rank == 0:
        result = forecast(tmp_path / "run", env=hiding_env(["tqdm"]))
    status, stdout, stderr, *_ = share(world, result)
    assert status == 0, stderr[-3000:]
    assert stdout.count("progress: tqdm is not installed, so progress comes as plain lines (pip install tqdm for a "
                        "bar)") == 1
    assert "train: 6/6 steps" in stderr and "forecast: 3/3 steps" in stderr
    assert stdout.strip().splitlines()[-1].startswith("forecast done:")


def _mount(folder, options):
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                          text=True)
    return done.returncode == 0


def test_a_full_or_read_only_output_folder(world, tmp_path):
    result = None
    if world.rank == 0:
        out = tmp_path / "small"
        out.mkdir()
        data = tmp_path / "data"
        made = forecast(data, "--stop-after", "1")  # a synthetic store outside the small folder
        if os.geteuid() != 0 or made[0] != 0 or not _mount(out, "size=600k"):
            result = "skip"
        else:
            try:
                store = str(data / "era5-synthetic.zarr")
                full = forecast(out, "--data", store, "--checkpoint-every", "1", "--keep", "3")
                files = sorted(os.listdir(out))
                subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True)
                read_only = forecast(out, "--data", store, "--resume", "auto")
                result = full, files, read_only
            finally:
                subprocess.run(["umount", str(out)], capture_output=True)
    result = share(world, result)
    if result == "skip":
        pytest.skip("needs root and a tmpfs mount")
    (status, stdout, stderr, *_), files, read_only = result
    assert status == 1, stderr[-3000:]
    [line] = program_lines(stderr)[-1:]
    found = re.fullmatch(r"python -m mpidomain forecast: error: could not write the checkpoint \S+checkpoint-(\d+).pt "
                         r"\(OSError: \[Errno 28\] No space left on device\); the newest complete checkpoint is still "
                         r"\S+checkpoint-(\d+).pt; free space or make the folder writable, then resume", line)
    assert found and int(found.group(2)) == int(found.group(1)) - 1, line
    newest = max(int(name[11:17]) for name in files if re.fullmatch(r"checkpoint-\d{6}\.pt", name))
    assert newest == int(found.group(2)) and not any(name.endswith(".partial") for name in files), files
    status, _, stderr, *_ = read_only
    assert status == 2 and program_lines(stderr)[-1].startswith(
        f"python -m mpidomain forecast: error: --out {tmp_path / 'small'}: cannot write there (OSError: Read-only "
        "file system)"), stderr[-2000:]


CASES = """
import contextlib, io, json, os, sys
from mpi4py import MPI
from mpidomain.__main__ import main

results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(args)
        except SystemExit as exit:
            status = exit.code
    results.append((args, status, err.getvalue()))
if MPI.COMM_WORLD.rank == 0:
    print(json.dumps(results))
"""


def test_every_option_with_a_bad_value_is_one_line_and_status_2(world, tmp_path):
    """Each case under ``mpiexec -n 4`` in one job (each ``main`` call in turn): exit status 2, one line naming the
    option, no traceback; a hang would end the job by the test's timeout."""
    result = None
    if world.rank == 0:
        empty, text, corrupt, a_file = (tmp_path / n for n in ("empty.pt", "text.pt", "corrupt.pt", "a_file"))
        empty.write_bytes(b"")
        text.write_text("model weights\n")
        corrupt.write_bytes(b"PK\x03\x04" + os.urandom(200))
        a_file.write_text("")
        foreign = tmp_path / "foreign.pt"
        torch.save({"format": "mpidomain-forecast-2"}, foreign)
        used = tmp_path / "used"
        used.mkdir()
        torch.save({"step": 2}, used / "checkpoint-000002.pt")
        store = tmp_path / "not_a_store"
        store.mkdir()
        (store / "notes.txt").write_text("mine")
        out = str(tmp_path / "out")
        base = ["forecast", "--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "2", "--rollout", "2"]
        cases = [
            ("-D", ["-D", "0"]), ("-D", ["-D", "2x0"]), ("-D", ["-D", "x"]), ("-D 3", ["-D", "3"]),
            ("--steps", ["--steps", "0"]), ("--steps", ["--steps", "two"]), ("--train-rollout", ["--train-rollout", "0"]),
            ("--rollout", ["--rollout", "-1"]), ("--batch", ["--batch", "0"]), ("--batch 3", ["--batch", "3"]),
            ("--grid", ["--grid", "0x4"]), ("--grid", ["--grid", "16"]), ("--times", ["--times", "0"]),
            ("--times 3", ["--times", "3"]), ("--lr", ["--lr", "inf"]), ("--lr", ["--lr", "-1"]),
            ("--lr", ["--lr", "nan"]), ("--seed", ["--seed", "-1"]), ("--model", ["--model", "gpt"]),
            ("--dtype", ["--dtype", "float16"]), ("--keep", ["--keep", "0"]),
            ("--checkpoint-every", ["--checkpoint-every", "0"]), ("--stop-signals", ["--stop-signals", "SIGKILL"]),
            ("--stop-signals", ["--stop-signals", "FOO"]), ("--stop-after", ["--stop-after", "0"]),
            ("--stop-after", ["--stop-after", "5"]), ("--variables", ["--variables", ","]),
            ("--variables", ["--variables", "t,nope", "--out", out]), ("--out", ["--out", str(a_file)]),
            ("--plot", ["--out", out, "--plot", str(tmp_path / "missing" / "f.png")]),
            ("--plot", ["--out", out, "--plot", str(tmp_path)]),
            ("--data", ["--data", str(tmp_path / "missing.zarr"), "--out", out]),
            ("--data", ["--data", str(store), "--out", out]),
            ("--resume", ["--resume", str(tmp_path / "missing.pt"), "--out", out]),
            ("--resume", ["--resume", str(empty), "--out", out]), ("--resume", ["--resume", str(text), "--out", out]),
            ("--resume", ["--resume", str(corrupt), "--out", out]),
            ("--resume", ["--resume", str(foreign), "--out", out]), ("--resume", ["--resume", str(tmp_path)]),
            ("--resume", ["--resume", ""]), ("--resume auto", ["--resume", "auto"]),
            ("--plot", ["--out", out, "--plot", str(tmp_path / "f.xyz")]), ("--grid", ["--grid", "18x32"]),
            ("--grid", ["--grid", "16x34", "-D", "2x2"]), ("--grid", ["--grid", "4x8", "-D", "4"]),
            ("--seed", ["--seed", str(2**64)]), ("--variables", ["--variables", "t2m,t2m"]),
            ("--data", ["--data", os.path.join(out, "forecast.zarr"), "--out", out]),
            ("--out", ["--out", str(used)]), ("--lr", ["--lr", "1e30", "--skip-nan", "--out", out + "-diverging"]),
            ("--amp", ["--amp", "fp8"]), ("--amp", ["--amp", "bf16", "--dtype", "float64"]),
            ("--rng", ["--rng", "per-rank"]),
        ]
        other = [("--halo-width", ["check", "--halo-width", "0"]), ("--repeats", ["check", "--repeats", "0"]),
                 ("--shape", ["check", "--shape", "1,2"]), ("--tensor-parallel-size", ["check", "-T", "0"]),
                 ("--bind-device", ["check", "--bind-device", "-1"]), ("--device", ["check", "--device", "tpu"]),
                 ("--steps", ["demo", "--steps", "0"]), ("--size", ["demo", "--size", "0x4"]), ("-D", ["demo", "-D", "0"]),
                 ("-D", ["info", "-D", "0"])]
        runs = [(name, base + args) for name, args in cases] + other
        done = run_mpi(4, ["-c", CASES, json.dumps([args for _, args in runs])], timeout=600)
        result = (done.returncode, done.stdout, done.stderr, [name for name, _ in runs])
    status, stdout, stderr, names = share(world, result)
    assert status == 0, stderr[-3000:]
    results = json.loads(stdout.strip().splitlines()[-1])
    for name, (args, code, err) in zip(names, results):
        lines = [line for line in err.strip().splitlines() if "error" in line]  # but the progress bar's
        assert code == 2, (args, code, err)
        assert len(lines) == 1 and "Traceback" not in err, (args, err)
        assert name.split()[0] in lines[0] and lines[0].startswith("python -m mpidomain "), (args, lines)

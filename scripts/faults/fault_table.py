"""The fault table of docs/long-runs.md: one fault on one rank of a 4-rank ``forecast``, how long every rank took
to end, and what the rerun with ``--resume auto`` gave against the uninterrupted run.

    python scripts/faults/fault_table.py [--srun] [--out DIR]

Each fault is injected by ``tests/fault_driver.py`` (a RuntimeError, a SIGKILL or a SIGUSR1 on one rank, at one
stage); ``--srun`` runs the kills under Slurm's ``srun -K --mpi=pmi2`` as well. Prints a Markdown table.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DRIVER = os.path.join(REPO, "tests", "fault_driver.py")
SMALL = ["--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "6", "--rollout", "3", "--checkpoint-every",
         "2"]
RAISES = [("setup", 3), ("data", 1), ("step", 2), ("checkpoint", 0), ("forecast", 1), ("write", 1), ("plot", 0),
          ("scores", 1)]
KILLS = [("kill:step:2:4", "training step 4"), ("kill:checkpoint:0:2", "half of checkpoint 4 written"),
         ("kill:write:1:2", "forecast step 2 half written"), ("signal:step:2:3", "SIGUSR1 after step 3")]


def environment():
    """This environment without the variables of a launcher that may have started this script."""
    prefixes = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "OMPI_", "PRTE_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def run(out, *args, fault=None, srun=False):
    """Run the forecast on 4 ranks; return (status, stdout, stderr, seconds from the fault to the end)."""
    program = [DRIVER, fault] if fault else ["-m", "mpidomain"]
    launcher = ["srun", "-n", "4", "-K", "--mpi=pmi2"] if srun else [
        os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "4"]
    done = subprocess.run([*launcher, sys.executable, *program, "forecast", *SMALL, "--out", out, *args],
                          env=environment(), capture_output=True, text=True, timeout=600, cwd=REPO)
    ended = time.time()
    faulted = re.search(r"FAULT \S+ ([\d.]+)", done.stderr)
    return done.returncode, done.stdout, done.stderr, ended - float(faulted.group(1)) if faulted else None


def outcome(out):
    import torch
    import xarray as xr

    losses = torch.load(os.path.join(out, "checkpoint.pt"), weights_only=False)["losses"]
    store = xr.open_zarr(os.path.join(out, "forecast.zarr"), consolidated=False, chunks=None).load()
    return losses, {name: store[name].values for name in [*store.data_vars, "time"]}


def equal(a, b):
    return a[0] == b[0] and sorted(a[1]) == sorted(b[1]) and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--srun", action="store_true", help="run the kills under srun too (a Slurm cluster is up)")
    parser.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="fault-table-")
    rows = []
    status, _, stderr, _ = run(os.path.join(root, "reference"))
    if status != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{stderr[-2000:]}")
    reference = outcome(os.path.join(root, "reference"))
    for stage, rank in RAISES:
        out = os.path.join(root, f"raise-{stage}")
        extra = ["--plot", os.path.join(out, "forecast.png")] if stage == "plot" else []
        status, _, stderr, seconds = run(out, *extra, fault=f"raise:{stage}:{rank}")
        rows.append((f"RuntimeError on rank {rank}", stage, f"{seconds:.1f} s, exit {status}", "-"))
    launchers = [False, True] if args.srun else [False]
    for srun in launchers:
        for fault, where in KILLS:
            if srun and fault.startswith("signal"):
                continue
            out = os.path.join(root, f"{fault.replace(':', '-')}-{'srun' if srun else 'mpiexec'}")
            status, stdout, stderr, seconds = run(out, fault=fault, srun=srun)
            rerun = run(out, "--resume", "auto", srun=srun)
            skipped = re.findall(r"--resume auto skips (\S+):", rerun[1])
            resumed = re.search(r"continuing from \S+ \(after step (\d+)\)", rerun[1])
            completing = re.search(r"completing the forecast in \S+: (\d+) of", rerun[1])
            said = [f"skipped {os.path.basename(p)}" for p in skipped]
            said += [f"resumed after step {resumed.group(1)}"] if resumed else []
            said += [f"{completing.group(1)} forecast step(s) kept"] if completing else []
            verdict = ("equal to the uninterrupted run" if rerun[0] == 0 and equal(outcome(out), reference)
                       else f"DIFFERS (exit {rerun[0]})")
            ended = f"exit {status}" if fault.startswith("signal") else f"{seconds:.1f} s, exit {status}"
            rows.append((f"{fault.split(':')[0]} rank {fault.split(':')[2]} ({'srun -K' if srun else 'mpiexec'})",
                         where, ended, "; ".join(said + [verdict])))
    print("| fault | where | every rank ended after | the rerun with --resume auto |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if not args.out:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

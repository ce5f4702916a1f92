"""The missing-package table of docs/long-runs.md: each optional package hidden from every rank of a 4-rank job
of ``forecast``, ``credit train`` and ``credit rollout``; the exit status, the line printed and how long every rank
took to end.

    python scripts/faults/missing_packages.py [--ranks 4] [--out DIR]

A package is hidden as ``tests/hide/sitecustomize.py`` does it (an import blocker on ``sys.meta_path`` in every
rank: ModuleNotFoundError, or RuntimeError for a package "built for another torch"). The CREDIT commands run on
the synthetic CREDIT-layout config (``mpidomain.credit.synthetic``; its files are not needed: the packages are
checked before any is read). Prints a Markdown table.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--model", "cnn", "--grid", "16x32", "--times", "12", "--steps", "2", "--rollout", "2"]

# (command, hidden, broken, extra arguments): forecast's arguments follow SMALL; CREDIT's take -c CONFIG.
CASES = [
    ("forecast", "tqdm", "", []),
    ("forecast", "matplotlib", "", ["--plot", "PNG"]),
    ("forecast", "", "matplotlib", ["--plot", "PNG"]),
    ("forecast", "xarray", "", []),
    ("forecast", "zarr", "", []),
    ("forecast", "torch", "", []),
    ("credit train", "yaml", "", []),
    ("credit train", "torch", "", []),
    ("credit train", "credit", "", []),
    ("credit train", "einops", "", []),
    ("credit train", "bridgescaler", "", []),
    ("credit train", "netCDF4", "", []),
    ("credit train", "pandas", "", []),
    ("credit rollout", "yaml", "", []),
    ("credit rollout", "credit", "", []),
    ("credit rollout", "bridgescaler", "", []),
    ("credit rollout", "netCDF4", "", []),
    ("credit rollout", "zarr", "", ["ZARR"]),
]


def environment(hidden, broken):
    """This environment without a launcher's variables, hiding ``hidden`` and breaking ``broken``."""
    prefixes = ("PMI_", "PMIX_", "HYDI_", "HYDRA_", "OMPI_", "PRTE_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join((os.path.join(REPO, "tests", "hide"), REPO))
    env.update(MPIDOMAIN_TEST_HIDE=hidden, MPIDOMAIN_TEST_BREAK=broken)
    return env


def configs(folder):
    """The synthetic CREDIT config with an inference block writing netCDF, and one writing Zarr: their paths."""
    import yaml

    from mpidomain.credit.synthetic import synthetic_config

    paths = {}
    for name, fmt in (("netcdf", "netcdf"), ("zarr", "zarr")):
        conf = synthetic_config(os.path.join(folder, "data"), save_loc=os.path.join(folder, f"run-{name}"))
        conf["inference"] = {"mode": "none", "save_forecast": os.path.join(folder, f"forecast-{name}"),
                             "batch_forecast": {"first_init_date": "2000-12-30T00", "last_init_date": "2000-12-30T00",
                                                "init_interval": "1d", "forecast_length": "12h"},
                             "output": {"format": fmt}}
        paths[name] = os.path.join(folder, f"{name}.yml")
        with open(paths[name], "w") as file:
            yaml.safe_dump(conf, file, sort_keys=False)
    return paths


def run(ranks, command, hidden, broken, args, folder, config):
    """One job: (exit status, the program's error lines, seconds to the end of every rank, a traceback?)."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if command == "forecast":
        out = os.path.join(folder, f"forecast-{hidden or broken}")
        shutil.rmtree(out, ignore_errors=True)
        arguments = ["forecast", *SMALL, "--out", out,
                     *[os.path.join(folder, "f.png") if a == "PNG" else a for a in args]]
    else:
        arguments = [*command.split(), "-c", config["zarr" if "ZARR" in args else "netcdf"]]
    began = time.perf_counter()
    done = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpidomain", *arguments],
                          env=environment(hidden, broken), capture_output=True, text=True, timeout=900, cwd=folder)
    seconds = time.perf_counter() - began
    lines = [line for line in done.stderr.splitlines() if ": error: " in line or line.startswith("mpidomain")]
    return done.returncode, lines, seconds, "Traceback" in done.stderr, done.stderr


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="ranks of each job (default: 4)")
    parser.add_argument("--out", help="folder for the runs (default: a temporary one, removed)")
    args = parser.parse_args(argv)
    folder = args.out or tempfile.mkdtemp(prefix="mpidomain-missing-")
    os.makedirs(folder, exist_ok=True)
    try:
        config = configs(folder)
        print(f"| command ({args.ranks} ranks) | package | exit | every rank ended after | what rank 0 printed |")
        print("|---|---|---|---|---|")
        for command, hidden, broken, extra in CASES:
            status, lines, seconds, traceback, stderr = run(args.ranks, command, hidden, broken, extra, folder, config)
            what = f"{hidden} hidden" if hidden else f"{broken} broken (RuntimeError at import)"
            said = "; ".join(lines)[:230] if lines else "(no error line)"
            if traceback:
                said += " [a traceback]"
            if status not in (0, 2):
                said += f" [stderr: {stderr.strip().splitlines()[-1][:120] if stderr.strip() else ''}]"
            print(f"| {command} | {what} | {status} | {seconds:.1f} s | {said} |", flush=True)
    finally:
        if not args.out:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

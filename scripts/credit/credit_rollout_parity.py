"""The parity table of ``python -m mpidomain credit rollout`` against CREDIT's own ``credit rollout``.

    python scripts/credit/credit_rollout_parity.py [--out FOLDER] [--layouts 1,2,4,2x2,2g]

Writes the synthetic CREDIT-layout dataset and gen2 config (``mpidomain.credit.synthetic``: 48 x 64, three of
five levels by nearest match, yearly netCDF files across a year boundary, two prognostic 3-D and two 2-D
variables, a diagnostic, a dynamic forcing and two statics, a slim CrossFormer with Earth padding), a
checkpoint in CREDIT's layout (``mpidomain.credit.reference.credit_checkpoint``) and an inference block: three
init times a day apart, four 6-hour steps each, netCDF, a metadata file. Then forecasts:

- with CREDIT's ``credit rollout`` in one process (CPU, float32, one thread), on the config as CREDIT needs it
  (``credit_rollout_config``: ``era5_normalizer`` as its converter's ``bridgescaler_transform``,
  ``inference.postblocks`` without the target's twin): the reference;
- with ``mpiexec -n N python -m mpidomain credit rollout`` on the same config and checkpoint at D = 1, 2, 4,
  2 x 2 tiles and D = 2 with two data-parallel groups splitting the init times (one thread per rank).

Prints, per layout, whether the files' names, dims, coordinates, attributes, dtypes, chunks and compression
are CREDIT's; each variable's worst difference from CREDIT's arrays over every file, relative to the
variable's largest value; the scores table's worst difference from the D=1 run's (one process's scores:
RMSE relative, ACC absolute); and the commands.
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LAYOUTS = {"1": ("D=1", 1, "1"), "2": ("D=2", 2, "2"), "4": ("D=4", 4, "4"), "2x2": ("2 x 2 tiles", 4, "2x2"),
           "2g": ("D=2, 2 groups", 4, "2")}
METADATA = {"temperature": {"units": "K", "long_name": "temperature"},
            "u_component_of_wind": {"units": "m s-1", "long_name": "eastward wind"},
            "SP": {"units": "Pa", "long_name": "surface pressure"}, "VAR_2T": {"units": "K"},
            "total_precipitation": {"units": "m", "long_name": "total precipitation"},
            "time": {"units": "hours since 1900-01-01", "calendar": "standard"}}
COORDINATES = ("time", "level", "latitude", "longitude")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"  # one torch thread per rank, as the reference
    return env


def _mpiexec():
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return local if os.path.exists(local) else shutil.which("mpiexec")


def _case(folder):
    """Write the data, the config CREDIT runs and its checkpoint; return the config's path."""
    import yaml

    from mpidomain.credit.reference import credit_checkpoint, credit_rollout_config
    from mpidomain.credit.synthetic import synthetic_config, write_synthetic_credit

    data = os.path.join(folder, "data-set")
    write_synthetic_credit(data)
    conf = synthetic_config(data)
    conf["save_loc"] = os.path.join(folder, "run")
    os.makedirs(conf["save_loc"], exist_ok=True)
    metadata = os.path.join(folder, "metadata.yaml")
    with open(metadata, "w") as file:
        yaml.safe_dump(METADATA, file)
    conf["inference"] = {"mode": "none", "save_forecast": os.path.join(folder, "credit"),
                         "batch_forecast": {"first_init_date": "2000-12-30T00", "last_init_date": "2001-01-01T00",
                                            "init_interval": "1d", "forecast_length": "24h"},
                         "output": {"format": "netcdf", "metadata": metadata}}
    conf = credit_rollout_config(conf, os.path.join(folder, "scalers"))
    credit_checkpoint(conf, os.path.join(conf["save_loc"], "checkpoint.pt"))
    path = os.path.join(folder, "rollout.yml")
    with open(path, "w") as file:
        yaml.safe_dump(conf, file, sort_keys=False)
    return path, conf["inference"]["save_forecast"]


def _files(folder):
    found = []
    for init in sorted(os.listdir(folder)):
        if os.path.isdir(os.path.join(folder, init)):
            found += [os.path.join(init, name) for name in sorted(os.listdir(os.path.join(folder, init)))]
    return found


def _summary(path):
    import netCDF4

    with netCDF4.Dataset(path) as ds:
        return (ds.data_model, [(a, repr(ds.getncattr(a))) for a in ds.ncattrs()],
                [(n, len(d)) for n, d in ds.dimensions.items()],
                [(name, str(v.dtype), v.dimensions, v.chunking(), v.filters(),
                  [(a, repr(v.getncattr(a))) for a in v.ncattrs()]) for name, v in ds.variables.items()])


def _values(path):
    import netCDF4

    with netCDF4.Dataset(path) as ds:
        ds.set_auto_maskandscale(False)
        return {name: np.asarray(v[...]) for name, v in ds.variables.items()}


def _compare(ours, credit):
    """(files the same, layout the same, {variable: worst relative difference})."""
    names = _files(ours)
    if names != _files(credit):
        return False, False, {}
    same_layout, worst = True, {}
    for name in names:
        a, b = os.path.join(ours, name), os.path.join(credit, name)
        same_layout &= _summary(a) == _summary(b)
        got, want = _values(a), _values(b)
        for variable, reference in want.items():
            if variable in COORDINATES:
                same_layout &= bool(np.array_equal(got[variable], reference))
                continue
            difference = float(np.abs(got[variable].astype(np.float64) - reference).max() / np.abs(reference).max())
            worst[variable] = max(worst.get(variable, 0.0), difference)
    return True, same_layout, worst


def _scores(path):
    with open(path, newline="") as file:
        return [row for row in csv.DictReader(file)]


def _scores_difference(ours, reference):
    """Worst relative RMSE and absolute ACC difference of two score tables (same rows)."""
    rmse = acc = 0.0
    for a, b in zip(ours, reference):
        assert (a["lead_hours"], a["variable"], a["level"]) == (b["lead_hours"], b["variable"], b["level"])
        rmse = max(rmse, abs(float(a["rmse"]) - float(b["rmse"])) / abs(float(b["rmse"])))
        acc = max(acc, abs(float(a["acc"]) - float(b["acc"])))
    return rmse, acc


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the data and the runs (default: a temporary folder, removed)")
    parser.add_argument("--layouts", default="1,2,4,2x2,2g", help="layouts (default: 1,2,4,2x2,2g; 2g: D=2 x 2 groups)")
    args = parser.parse_args()
    from mpidomain.credit.reference import run_credit_rollout

    folder = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="credit-rollout-parity-")
    os.makedirs(folder, exist_ok=True)
    try:
        config, reference = _case(folder)
        shutil.rmtree(reference, ignore_errors=True)
        began = time.perf_counter()
        credit = run_credit_rollout(config)
        credit_seconds = time.perf_counter() - began
        if credit["returncode"]:
            raise SystemExit(f"CREDIT's credit rollout failed:\n{credit['output'][-3000:]}")
        columns, commands = [], ["python -m mpidomain.credit.reference rollout rollout.yml   # CREDIT's credit "
                                 f"rollout, one process: {credit_seconds:.1f} s"]
        for key in args.layouts.split(","):
            name, ranks, domain = LAYOUTS[key]
            save = os.path.join(folder, "ours-" + key)
            shutil.rmtree(save, ignore_errors=True)
            command = [_mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpidomain", "credit", "rollout", "-c",
                       config, "-D", domain, "--save-dir", save]
            began = time.perf_counter()
            done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=1800)
            seconds = time.perf_counter() - began
            if done.returncode:
                raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
            commands.append(f"mpiexec -n {ranks} python -m mpidomain credit rollout -c rollout.yml -D {domain} "
                            f"--save-dir ours-{key}   # {name}: {seconds:.1f} s")
            columns.append((name, save, _compare(save, reference)))
        base = _scores(os.path.join(columns[0][1], "scores.csv"))
        variables = sorted({v for _, _, (_, _, worst) in columns for v in worst}, key=list(METADATA).index)
        print(f"credit rollout: 3 forecasts x 4 steps of 6 h on 48 x 64, against CREDIT's one-process credit rollout "
              f"(its {len(_files(reference))} netCDF files)\n")
        print("| | " + " | ".join(name for name, _, _ in columns) + " |")
        print("|---|" + "---|" * len(columns))
        print("| file names | " + " | ".join("CREDIT's" if same else "differ" for _, _, (same, _, _) in columns) + " |")
        print("| dims, coordinates, attributes, dtypes, chunks, compression | "
              + " | ".join("CREDIT's" if layout else "differ" for _, _, (_, layout, _) in columns) + " |")
        for variable in variables:
            print(f"| {variable}: worst difference / largest value | "
                  + " | ".join("0 (bitwise)" if worst.get(variable) == 0 else f"{worst.get(variable, float('nan')):.1e}"
                               for _, _, (_, _, worst) in columns) + " |")
        differences = [_scores_difference(_scores(os.path.join(save, "scores.csv")), base) for _, save, _ in columns]
        print(f"| scores: RMSE, relative to {columns[0][0]}'s | " + " | ".join(
            "0" if r == 0 else f"{r:.1e}" for r, _ in differences) + " |")
        print(f"| scores: ACC, difference from {columns[0][0]}'s | " + " | ".join(
            "0" if a == 0 else f"{a:.1e}" for _, a in differences) + " |")
        print("\ncommands (one torch thread per rank, OMP_NUM_THREADS=1):")
        for line in commands:
            print("  " + line)
    finally:
        if not args.out:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

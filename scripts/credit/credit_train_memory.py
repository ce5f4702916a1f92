"""Peak memory and bytes read per rank of ``credit train`` at 0.25 degrees, against CREDIT's pattern.

    python scripts/credit/credit_train_memory.py [--out FOLDER] [--layouts 1,2,4,2x2]

The job of ``mpidomain.credit.synthetic`` at 721 x 1440 with CREDIT's 0.25-degree example's channels
(``wxformer_era5_025deg_6hr.yml``: U, V, T, specific_total_water at 13 levels, 4 prognostic surface
fields, 8 diagnostics, 2 dynamic forcings, 2 statics; 60 input and 64 output channels), a slim CrossFormer
(dims 8..64, Earth padding to 768 x 1472), ``forecast_len: 2``, batch 1, one optimizer step. Each layout
runs as its own ``mpiexec -n N`` job of this script (``--worker``), which trains in process and reports,
from the largest rank: the peak resident memory, the resident memory before the first step (imports,
model, optimizer), the bytes of values it read, and ``--estimate``'s prediction.

CREDIT's own domain-parallel trainer reads the whole sample on every rank and holds the whole gathered
prediction between rollout steps; at 721 rows it cannot shard at all (``shard_spatial`` needs the height
divisible by D): the CREDIT columns are that pattern's bytes (the whole sample per rank, which the D=1
run measures) and the message CREDIT's own ``shard_spatial`` raises.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

LEVELS = (25.5, 75.0, 125.0, 175.0, 225.0, 275.0, 350.0, 450.0, 550.0, 650.0, 775.0, 887.5, 962.5)
GRID = (721, 1440)


def _variables():
    spec = {name: ("prognostic", "3d", mean, amp) for name, mean, amp in
            (("U", 10.0, 8.0), ("V", 0.0, 6.0), ("T", 250.0, 6.0), ("specific_total_water", 0.004, 0.002))}
    spec.update({name: ("prognostic", "2d", mean, amp) for name, mean, amp in
                 (("SP", 98000.0, 900.0), ("VAR_2T", 285.0, 8.0), ("VAR_10U", 2.0, 4.0), ("VAR_10V", 0.0, 4.0))})
    spec.update({f"diagnostic_{i}": ("diagnostic", "2d", 1.0, 0.5) for i in range(8)})
    spec.update({name: ("dynamic_forcing", "2d", mean, amp) for name, mean, amp in
                 (("toa_incident_solar_radiation", 1.2e6, 9e5), ("land_sea_CI_mask", 0.3, 0.3))})
    return spec


def _config(folder):
    from mpidomain.credit.synthetic import synthetic_config

    conf = synthetic_config(folder, GRID, variables=_variables(), config_levels=LEVELS, batch=1,
                            batches_per_epoch=1, epochs=1)
    for block in ("data", "validation_data"):
        conf[block].update(start_datetime="2001-01-01T00:00:00", end_datetime="2001-01-01T12:00:00")
    conf["trainer"].update(skip_validation=True, use_ema=False)
    return conf


def _worker(folder, layout):
    import numpy as np
    import torch
    import yaml
    from mpi4py import MPI

    from mpidomain.credit.config import parse_domain, read_settings
    from mpidomain.credit.estimate import estimate_lines
    from mpidomain.credit.trainer import TrainOptions, train
    from mpidomain.manager import initialize_domain_parallel

    world = MPI.COMM_WORLD
    with open(os.path.join(folder, "memory.yml")) as file:
        conf = yaml.safe_load(file)
    domain = parse_domain(layout)
    conf["save_loc"] = os.path.join(folder, f"run-{layout}")
    settings = read_settings(conf, world.size, domain)
    estimate = [line for line in estimate_lines(settings) if "activations" in line] if world.rank == 0 else None
    manager = initialize_domain_parallel(world.size, domain if len(domain) == 2 else domain[0],
                                         (-2, -1) if len(domain) == 2 else -2)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.size))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    summary = train(settings, TrainOptions(progress=False), manager, say=lambda line: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    records = world.gather((peak, before, summary["run"].bytes_read, float(np.sum(summary["run"].step_seconds))))
    manager.close()
    if world.rank == 0:
        largest = max(records)
        print(json.dumps({"layout": layout, "peak": largest[0], "before": largest[1],
                          "read": max(r[2] for r in records), "seconds": max(r[3] for r in records),
                          "estimate": estimate[0].strip()}), flush=True)


def _credit_refusal():
    """The message CREDIT's own trainer gives for 721 rows at D=2 (its shard_spatial)."""
    import types

    import torch

    from mpidomain.models import credit_crossformer_module

    credit_crossformer_module()  # CREDIT's domain-parallel package imports its CrossFormer (torchvision stand-in)
    from credit.parallel.domain import shard_spatial

    try:
        shard_spatial(torch.zeros(1, 1, GRID[0], 4), types.SimpleNamespace(domain_parallel_size=2))
    except ValueError as error:
        return str(error)
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the data and runs (default: a temporary folder, removed)")
    parser.add_argument("--layouts", default="1,2,4,2x2", help="layouts to run (default: 1,2,4,2x2)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.out, args.worker)
    import numpy as np
    import yaml

    from mpidomain.credit.estimate import sample_bytes
    from mpidomain.credit.synthetic import write_synthetic_credit
    from mpidomain.credit.config import read_settings

    folder = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="credit-train-memory-")
    try:
        if not os.path.exists(os.path.join(folder, "memory.yml")):
            os.makedirs(folder, exist_ok=True)
            times = np.datetime64("2001-01-01T00", "ns") + np.arange(3) * np.timedelta64(6, "h")
            write_synthetic_credit(folder, GRID, variables=_variables(), config_levels=LEVELS, levels=LEVELS,
                                   times=times)
            with open(os.path.join(folder, "memory.yml"), "w") as file:
                yaml.safe_dump(_config(folder), file, sort_keys=False)
        with open(os.path.join(folder, "memory.yml")) as file:
            conf = yaml.safe_load(file)
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        rows = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        for layout in args.layouts.split(","):
            ranks = int(np.prod([int(p) for p in layout.split("x")]))
            command = [mpiexec, "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--out", folder,
                       "--worker", layout]
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=7200)
            if done.returncode:
                raise SystemExit(f"{layout}: {done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        settings = read_settings(conf, 1, (1,))
        _, held_whole_read, read_whole, held_whole = sample_bytes(settings, GRID, (1,))
        refusal = _credit_refusal()
        mib = lambda n: f"{n / 2**20:.0f} MiB"  # noqa: E731
        print(f"credit train, one optimizer step of forecast_len 2 on {GRID[0]} x {GRID[1]} (60 input, 64 output "
              "channels, 13 levels), batch 1; largest rank:\n")
        print("| layout | peak RSS | RSS before the step | bytes read | CREDIT's pattern: bytes read per rank | "
              "CREDIT's pattern: sample + gathered prediction held | predicted activations |")
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(f"| D={row['layout']} | {mib(row['peak'])} | {mib(row['before'])} | {mib(row['read'])} | "
                  f"{mib(read_whole)} | {mib(held_whole)} | {row['estimate'].split(': ', 1)[1]} |")
        print(f"\nCREDIT's own domain-parallel trainer at D=2 on this grid: {refusal}")
        print("commands: " + "; ".join(f"mpiexec -n {int(np.prod([int(p) for p in r['layout'].split('x')]))} "
                                       f"python -m mpidomain credit train -c memory.yml -D {r['layout']}" for r in rows))
    finally:
        if not args.out:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

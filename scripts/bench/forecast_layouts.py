"""The forecast job at every layout of 4 ranks: how far the losses and the forecast store are from D = 1.

    mpiexec -n 4 python scripts/bench/forecast_layouts.py [--model cnn|crossformer] [--grid 16x32] [--steps 6]

Runs ``mpidomain.forecast.run_forecast`` in this job at D = 1 (four data-parallel groups), 2, 4 and 2 x 2, in
float64 and float32, each in its own folder, and prints per layout and precision the largest relative
difference of the losses and of every array of the forecast store against D = 1's.
"""

import argparse
import os
import sys
import tempfile

import numpy as np
import torch
import xarray as xr
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpidomain.forecast import ForecastSettings, run_forecast  # noqa: E402

WORLD = MPI.COMM_WORLD


def relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def run(folder, **settings):
    run_forecast(ForecastSettings(out=folder, **settings), out=lambda line: None)
    losses = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=False)["losses"]
    forecast = xr.open_zarr(os.path.join(folder, "forecast.zarr"), consolidated=False, chunks=None).load()
    return losses, forecast


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn", choices=("cnn", "crossformer"))
    parser.add_argument("--grid", default="16x32", help="latitudes x longitudes (default 16x32)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    if WORLD.size != 4:
        sys.exit("run with mpiexec -n 4")
    grid = tuple(int(n) for n in args.grid.split("x"))
    root = WORLD.bcast(tempfile.mkdtemp() if WORLD.rank == 0 else None)
    common = dict(model=args.model, grid=grid, times=12, steps=args.steps, rollout=3, batch=4)
    for dtype in ("float64", "float32"):
        runs = {d: run(os.path.join(root, f"{dtype}-{d}"), domain=d, dtype=dtype, **common) for d in (1, 2, 4, (2, 2))}
        losses0, forecast0 = runs[1]
        for d, (losses, forecast) in runs.items():
            arrays = max(relative(forecast[v].values, forecast0[v].values) for v in forecast0.data_vars)
            if WORLD.rank == 0:
                layout = "x".join(map(str, d)) if isinstance(d, tuple) else str(d)
                print(f"{args.model} {dtype} D={layout:<4} losses {relative(losses, losses0):.1e}, forecast store "
                      f"{arrays:.1e} (largest relative difference from D=1; final loss {losses[-1]:.6f})", flush=True)


if __name__ == "__main__":
    main()

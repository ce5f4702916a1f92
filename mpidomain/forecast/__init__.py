"""``python -m mpidomain forecast``: a forecast from disk to disk, domain x data parallel.

Needs torch and the ``forecast`` extra (xarray, zarr, tqdm; matplotlib for ``--plot``);
:class:`ForecastSettings` alone needs none of them (the command line reads its defaults).
"""

from .settings import ForecastSettings

__all__ = ["ForecastSettings", "run_forecast", "write_synthetic_store"]


def __getattr__(name):
    if name == "run_forecast":  # imports torch, xarray and zarr
        from .job import run_forecast

        return run_forecast
    if name == "write_synthetic_store":
        from .synthetic import write_synthetic_store

        return write_synthetic_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

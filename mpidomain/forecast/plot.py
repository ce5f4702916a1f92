"""The forecast job's picture: the loss curve, and one forecast field next to the truth (matplotlib)."""

import numpy as np
import xarray as xr

__all__ = ["draw"]


def draw(png, job, forecast_path):
    """Draw ``png``: the training loss by step, then the first channel of the last forecast step beside the truth.

    Local (one rank): reads that one field of the forecast store and of the data, whole.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, levels = job.layout[0]
    lead = job.settings.rollout
    pick = {"level": 0} if levels else {}
    forecast = xr.open_zarr(forecast_path, consolidated=False, chunks=None)[name].isel(time=-1, **pick)
    truth = job.data[name].isel(time=job.init_time + lead, **pick)
    label = f"{name}@{int(job.data['level'].values[0])}" if levels else name
    units = job.data[name].attrs.get("units", "")
    figure, axes = plt.subplots(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [1, 1.3, 1.3]})
    steps = np.arange(1, len(job.losses) + 1)
    axes[0].semilogy(steps, job.losses, marker="o", markersize=3)
    tuned = [s for s in steps if job.rollout_of(s) > 1]
    if tuned:
        axes[0].axvspan(tuned[0] - 0.5, tuned[-1] + 0.5, alpha=0.15, label=f"{job.settings.train_rollout}-step rollout")
        axes[0].legend()
    axes[0].set(title="training loss (latitude-weighted MSE)", xlabel="step")
    low, high = float(min(truth.min(), forecast.min())), float(max(truth.max(), forecast.max()))
    extent = [float(job.data["longitude"][0]), float(job.data["longitude"][-1]),
              float(job.data["latitude"][-1]), float(job.data["latitude"][0])]
    for axis, field, title in ((axes[1], forecast, f"forecast, lead {lead}"), (axes[2], truth, "truth")):
        image = axis.imshow(np.asarray(field), extent=extent, aspect="auto", vmin=low, vmax=high, cmap="RdBu_r",
                            origin="upper" if job.data["latitude"][0] > job.data["latitude"][-1] else "lower")
        axis.set(title=f"{label} {title}", xlabel="longitude", ylabel="latitude")
        figure.colorbar(image, ax=axis, label=units)
    figure.tight_layout()
    figure.savefig(png, dpi=100)
    plt.close(figure)

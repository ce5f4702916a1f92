"""``credit train --estimate``: each rank's memory and bytes read for a config's layout, before launch.

Local and one process: no data is read (the grid is the model's ``image_height`` x ``image_width``) and
no activation is allocated (:func:`mpidomain.nn.estimate_memory` runs the model on the meta device).
Beside each number, CREDIT's own domain-parallel pattern for the same job: every rank reads the whole
sample and holds the whole gathered prediction between rollout steps.
"""

from ..layout.tiles import balanced_split

__all__ = ["sample_bytes", "estimate_lines"]


def _channels(settings):
    """(input channels per time, target channels, dynamic forcing channels, static channels)."""
    source = settings.conf["model"].get("levels")
    levels = len(settings.data.levels) if settings.data.levels else int(source or 0)
    count = {}
    for field in settings.data.fields:
        count[field.kind] = levels * len(field.vars_3d) + len(field.vars_2d)
    prognostic, diagnostic = count.get("prognostic", 0), count.get("diagnostic", 0)
    forcing, static = count.get("dynamic_forcing", 0), count.get("static", 0)
    return prognostic + forcing + static, prognostic + diagnostic, forcing, static


def sample_bytes(settings, shape, domain):
    """Bytes of values one rank reads per optimizer step, and those it holds of one rollout step's sample
    (input, target, prediction), for its largest tile: ``(read, held, read_whole, held_whole)``; pure.

    ``read_whole`` and ``held_whole`` are CREDIT's pattern (the whole field on every rank, the prediction
    gathered between rollout steps).
    """
    grid = tuple(domain) + (1,) * (2 - len(domain))
    rows = max(balanced_split(shape[0], grid[0])[0])
    columns = max(balanced_split(shape[1], grid[1])[0])
    inputs, targets, forcing, _ = _channels(settings)
    history, steps, batch = settings.data.history_len, settings.data.forecast_len, settings.batch
    read_channels = inputs * history + targets + (steps - 1) * (forcing + targets)
    members = settings.ensemble_size  # the model's input and prediction hold every member
    held_channels = inputs * history * members + targets * (1 + members)
    cell, whole = rows * columns * 4 * batch, shape[0] * shape[1] * 4 * batch
    return read_channels * cell, held_channels * cell, read_channels * whole, held_channels * whole


def estimate_lines(settings, rng="tile"):
    """The lines ``--estimate`` prints for ``settings`` (its domain layout) and ``--rng``. Local; builds the model
    on the CPU."""
    import torch
    from credit.seed import seed_everything

    from ..nn import estimate_draws, estimate_memory
    from .model import build_model

    model_conf = settings.conf["model"]
    shape = (int(model_conf["image_height"]), int(model_conf["image_width"]))
    seed_everything(settings.seed)
    model = build_model(settings.conf, None, torch.device("cpu"))
    inputs, _, _, _ = _channels(settings)
    layout = settings.domain if len(settings.domain) == 2 else settings.domain[0]
    input_shape = (settings.batch * settings.ensemble_size, inputs, settings.data.history_len) + shape
    activations = estimate_memory(model, input_shape, layout)
    draws = estimate_draws(model, input_shape)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    state = parameters * (4 + (1 if settings.use_ema else 0))  # weights, gradients, AdamW's two moments, EMA
    read, held, read_whole, held_whole = sample_bytes(settings, shape, settings.domain)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    name = "x".join(map(str, settings.domain))
    ranks = 1
    for d in settings.domain:
        ranks *= d
    dropout = [] if not draws.calls else [
        f"  dropout ({draws.calls} calls per forward), --rng {rng}: " + (
            f"each rank draws the whole field's masks, {mib(draws.total_bytes)} per forward, the largest "
            f"{mib(draws.largest_bytes)} at once (transient)" if rng == "one-process" else
            f"each rank draws its tile's masks, about {mib(draws.total_bytes / ranks)} per forward (--rng "
            f"one-process: {mib(draws.total_bytes)}, the largest {mib(draws.largest_bytes)} at once)")]
    return [
        f"estimate for D={name} ({'tiles' if len(settings.domain) == 2 else 'latitude slabs'}) on {shape[0]} x "
        f"{shape[1]}, batch {settings.batch} per group"
        f"{f' x {settings.ensemble_size} members' if settings.ensemble_size > 1 else ''}, forecast_len "
        f"{settings.data.forecast_len}, "
        f"{settings.conf['model'].get('type')} model of {parameters / 2**20:.1f} MiB:",
        f"  activations saved for backward (one rollout step): {mib(activations.bytes_per_rank)} on the largest "
        f"rank ({activations.ratio:.3f} of one process's {mib(activations.one_process_bytes)})",
        f"  weights, gradients, AdamW state{' and EMA' if settings.use_ema else ''}: {mib(state)} per rank",
        f"  sample held per rank (input, target, prediction of a step): {mib(held)}; CREDIT's pattern (whole "
        f"sample, gathered prediction): {mib(held_whole)}",
        f"  bytes read per rank per optimizer step: {mib(read)}; CREDIT's pattern (whole sample on every rank): "
        f"{mib(read_whole)}",
        f"  total per rank: about {mib(activations.bytes_per_rank + state + held)} (CREDIT's pattern at the same "
        f"activations: {mib(activations.bytes_per_rank + state + held_whole)})",
    ] + dropout

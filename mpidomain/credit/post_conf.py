"""The model's ``post_conf`` (CREDIT's gen1 fixers inside the model) in ``credit rollout``: :func:`model_fixers`.

CREDIT's gen2 rollout hands ``model.post_conf`` to the model, which cannot build an active one there (its
parser's ``tracer_inds`` are missing); its gen2 training drops it. ``credit rollout`` here applies what
it activates after each step, on each tile, in physical units (``denorm: True``, CREDIT's default):

- ``tracer_fixer``: pointwise, by CREDIT's own gen2 class (``credit.postblock.conservation.TracerFixer``):
  each named variable clamped to ``tracer_thres`` (and ``tracer_thres_max``), written and fed back so;
- ``global_mass_fixer``, ``global_water_fixer``, ``global_energy_fixer``: they need the whole field's
  area-weighted integrals, so they are refused with one line until they are computed by tile.
"""

from ..command import UsageError

__all__ = ["model_fixers"]

GLOBAL_FIXERS = ("global_mass_fixer", "global_water_fixer", "global_energy_fixer")


def _listed(value):
    return list(value) if isinstance(value, (list, tuple)) else [value]


def model_fixers(model_conf, target_keys):
    """Return ``(apply, words)`` for ``model.post_conf``: ``apply(prediction)`` fixes a step's prediction
    (``{key: tensor}`` in physical units, this rank's tile) and returns it; ``words`` says what it does
    (None when nothing is active). Pure and local; a setting it cannot honour raises :class:`UsageError`
    naming the key (alike on every rank: they read the same config)."""
    post = (model_conf or {}).get("post_conf")
    if not isinstance(post, dict) or not post.get("activate"):
        return (lambda prediction: prediction), None
    for name in GLOBAL_FIXERS:
        if isinstance(post.get(name), dict) and post[name].get("activate"):
            raise UsageError(f"model.post_conf.{name}.activate = True: a global fixer needs the whole field's "
                             "integrals, which credit rollout does not compute by tile yet; set it to False")
    tracer = post.get("tracer_fixer")
    if not isinstance(tracer, dict) or not tracer.get("activate"):
        return (lambda prediction: prediction), None
    if not tracer.get("denorm", True):
        raise UsageError("model.post_conf.tracer_fixer.denorm = False: thresholds in normalised units are not "
                         "applied by tile; give them in physical units with denorm: True")
    names = _listed(tracer.get("tracer_name") or [])
    lows, highs = tracer.get("tracer_thres"), tracer.get("tracer_thres_max")
    lows = _listed(lows) if isinstance(lows, (list, tuple)) else [lows] * len(names)  # a number: for every name
    highs = _listed(highs) if isinstance(highs, (list, tuple)) else [highs] * len(names)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in lows) and \
        all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in highs)
    if not names or not numbers or len(lows) != len(names) or len(highs) != len(names):
        raise UsageError(f"model.post_conf.tracer_fixer: tracer_name {names}, tracer_thres "
                         f"{tracer.get('tracer_thres')} and tracer_thres_max {tracer.get('tracer_thres_max')}: "
                         "expected names and a number (or one per name) for each threshold")
    by_name = {key.split("/")[-1]: key for key in target_keys}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise UsageError(f"model.post_conf.tracer_fixer.tracer_name = {names}: {', '.join(missing)} is not a "
                         f"predicted variable (the model predicts {', '.join(by_name)})")
    from credit.postblock.conservation import TracerFixer

    keys = [by_name[name] for name in names]
    fixer = TracerFixer(keys, [float(v) for v in lows], [None if v is None else float(v) for v in highs])
    source = keys[0].split("/")[0]

    def apply(prediction):
        return fixer({"y_processed": {source: dict(prediction)}})["y_processed"][source]

    bounds = ", ".join(f"{name} >= {float(lo):g}" + ("" if hi is None else f" and <= {float(hi):g}")
                       for name, lo, hi in zip(names, lows, highs))
    return apply, f"model.post_conf.tracer_fixer: after each step, {bounds} (CREDIT's TracerFixer, by tile)"

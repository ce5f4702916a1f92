"""The config's model, built by CREDIT's own loader and made domain-parallel: :func:`build_model`.

``credit.models.load_model(conf)`` after CREDIT's ``seed_everything(seed)`` gives the same initial
weights as ``credit train``; :func:`mpidomain.nn.convert_to_domain_parallel` makes every rank compute
its tile's rows of the one-process output (the state dict keys do not change, so checkpoints load
both ways). :func:`training_wrappers` adds what ``trainer.compile``, ``activation_checkpoint`` and
``amp`` ask for.
"""

import copy

import torch

from ..command import UsageError
from ..models import credit_crossformer_module
from ..nn import TrainingOptions, convert_to_domain_parallel, prepare_training

__all__ = ["build_model", "training_conf", "training_options", "training_wrappers", "unwrapped"]


def training_conf(conf):
    """Return ``(conf, post_conf_active)``: a copy of ``conf`` prepared as CREDIT's ``train_gen2`` prepares it
    before it builds the loss and the model, and whether ``model.post_conf`` asked for postblocks.

    CREDIT's own steps, called, not copied: ``credit.trainers.utils.inject_flat_var_keys`` (the flat
    ``data.variables``, ``surface_variables``, ``diagnostic_variables`` that the flat loss form reads), and
    ``model.post_conf`` removed (gen2 training never applies gen1 postblocks; CREDIT warns, then hides its
    warnings). Local and pure.
    """
    from credit.trainers.utils import inject_flat_var_keys

    conf = copy.deepcopy(conf)
    post_conf = conf.get("model", {}).pop("post_conf", None)
    inject_flat_var_keys(conf)
    return conf, bool(isinstance(post_conf, dict) and post_conf.get("activate"))


def build_model(conf, manager, device, rng="tile"):
    """Return CREDIT's model of ``conf`` (``load_model``), converted for ``manager`` (its random layers drawing
    as ``rng`` says: :mod:`mpidomain.nn.rng`) and on ``device``.

    Local; call on every rank alike after seeding (every rank builds the same weights). A model the converter
    cannot make exact raises :class:`UsageError` naming it.
    """
    credit_crossformer_module()  # CREDIT's CrossFormer modules import torchvision through gen1 postblocks
    from credit.models import load_model

    conf = copy.deepcopy(conf)
    conf["model"].pop("post_conf", None)  # gen2 never builds gen1 postblocks (credit train pops it too)
    try:
        model = load_model(conf)
    except (TypeError, ValueError, KeyError) as error:
        raise UsageError(f"model: CREDIT's load_model refused the model block ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if manager is not None and manager.domain_parallel_size > 1:
        layout = 'x'.join(map(str, manager.domain_shape)) if manager.tiled else manager.domain_parallel_size
        try:
            model = convert_to_domain_parallel(model, manager=manager, rng=rng)
        except ValueError as error:
            lines = str(error).splitlines()
            raise UsageError(f"model.type = {conf['model'].get('type')!r}: cannot run it domain-parallel at "
                             f"D={layout}{' with --rng ' + rng if rng != 'tile' else ''}: "
                             f"{'; '.join(line.strip() for line in lines[:-1] or lines)}") from None
        problem = _padding_problem(model, conf["model"], manager)
        if problem:
            raise UsageError(f"model.padding_conf = {conf['model'].get('padding_conf')}: cannot run "
                             f"{conf['model'].get('type')!r} at D={layout}: {problem}")
    return model.to(device)


def _padding_problem(model, model_conf, manager):
    """Why the converted model's padding cannot deal the config's grid over the manager's layout (and which
    layouts can), or None: before any sample is read, not at the first step. Local and pure."""
    from ..nn import DomainParallelTensorPadding

    rows, columns = model_conf.get("image_height"), model_conf.get("image_width")
    if not (isinstance(rows, int) and isinstance(columns, int)):
        return None
    for module in model.modules():
        padding = getattr(module, "padding_opt", None)
        if isinstance(padding, DomainParallelTensorPadding):
            problem = padding.check_layout(rows, columns, manager.domain_shape if manager.tiled else
                                           (manager.domain_parallel_size,))
            if problem:
                return problem
    return None


def unwrapped(model):
    """The model under the training wrappers (a checkpoint wrapper or ``torch.compile``'s; their state dict keys
    are the model's)."""
    for name in ("_checkpoint_wrapped_module", "_orig_mod"):
        model = getattr(model, name, model)
    return model


def training_options(settings, device, amp=None):
    """Return the :class:`~mpidomain.nn.TrainingOptions` of ``trainer.compile``, ``activation_checkpoint`` and
    ``amp`` (CREDIT's: float16 with a scaler on CUDA; as CREDIT's ``torch.autocast(device_type="cuda")`` does
    on a CPU, nothing there), or ``amp="bf16"`` (the command line's ``--amp bf16``: bfloat16 on any device)."""
    chosen = amp if amp is not None else ("fp16" if settings.amp and device.type == "cuda" else None)
    return TrainingOptions(compile=settings.compile, activation_checkpoint=settings.activation_checkpoint,
                           checkpoint_like_credit=True, amp=chosen)


def training_wrappers(model, settings, device, manager, amp=None):
    """Return ``(model, autocast, scaler, options, blocks)`` for ``trainer.compile``, ``activation_checkpoint`` and
    ``amp`` (:func:`training_options`), made by :func:`mpidomain.nn.prepare_training`.

    ``activation_checkpoint`` wraps the blocks CREDIT's models mark (``_fsdp2_shard``) in non-reentrant
    checkpointing exactly as CREDIT's gen2 wrapper does (``TrainingOptions.checkpoint_like_credit``: nothing
    where the model marks nothing, as the ``crossformer`` type; the recomputation in backward repeats each halo
    exchange in the same order on every rank); ``compile`` compiles the model (each checkpointed block, with both);
    ``autocast()`` returns a fresh context manager; ``scaler`` is the float16 run's
    :class:`~mpidomain.nn.AgreedGradScaler` (its skip decision the same on every rank), else a disabled
    ``GradScaler`` (its calls pass through); ``blocks``: the paths of the checkpointed blocks. Local.
    """
    options = training_options(settings, device, amp)
    setup = prepare_training(model, options, manager=manager)
    scaler = setup.scaler if setup.scaler is not None else torch.amp.GradScaler("cuda", enabled=False)
    return setup.model, setup.autocast, scaler, options, setup.blocks

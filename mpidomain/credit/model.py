"""The config's model, built by CREDIT's own loader and made domain-parallel: :func:`build_model`.

``credit.models.load_model(conf)`` after CREDIT's ``seed_everything(seed)`` gives the same initial
weights as ``credit train``; :func:`mpidomain.nn.convert_to_domain_parallel` makes every rank compute
its tile's rows of the one-process output (the state dict keys do not change, so checkpoints load
both ways). :func:`training_wrappers` adds what ``trainer.compile``, ``activation_checkpoint`` and
``amp`` ask for.
"""

import contextlib
import copy

import torch

from ..command import UsageError
from ..models import credit_crossformer_module
from ..nn import convert_to_domain_parallel

__all__ = ["build_model", "training_wrappers", "unwrapped"]


def build_model(conf, manager, device):
    """Return CREDIT's model of ``conf`` (``load_model``), converted for ``manager`` and on ``device``.

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
        try:
            model = convert_to_domain_parallel(model, manager=manager)
        except ValueError as error:
            raise UsageError(f"model.type = {conf['model'].get('type')!r}: cannot run it domain-parallel at "
                             f"D={'x'.join(map(str, manager.domain_shape)) if manager.tiled else manager.domain_parallel_size}: "
                             f"{str(error).splitlines()[0]}") from None
    return model.to(device)


def unwrapped(model):
    """The model under ``torch.compile``'s wrapper (whose state dict keys are the model's)."""
    return getattr(model, "_orig_mod", model)


def training_wrappers(model, settings, device):
    """Return ``(model, autocast, scaler)`` for ``trainer.compile``, ``activation_checkpoint`` and ``amp``.

    ``activation_checkpoint`` wraps the blocks CREDIT's models mark (``_fsdp2_shard``) in non-reentrant
    checkpointing, as CREDIT's gen2 wrapper does (the recomputation in backward repeats each halo
    exchange in the same order on every rank); ``compile`` is ``torch.compile``; ``amp`` autocasts to
    float16 with a ``GradScaler`` on CUDA devices, and, as CREDIT's ``torch.autocast(device_type="cuda")``
    does on a CPU, changes nothing there. ``autocast()`` returns a fresh context manager. Local.
    """
    if settings.activation_checkpoint:
        from credit.parallel.fsdp2 import _apply_activation_checkpointing

        _apply_activation_checkpointing(model)
    if settings.compile:
        model = torch.compile(model)
    use_amp = settings.amp and device.type == "cuda"

    def autocast():
        if use_amp:
            return torch.autocast(device_type="cuda", dtype=torch.float16)
        return contextlib.nullcontext()

    scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
    return model, autocast, scaler

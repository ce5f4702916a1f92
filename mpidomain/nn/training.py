"""The training stack a command switches on for a converted model: torch.compile, activation checkpointing,
mixed precision (:func:`prepare_training`).

- **compile**: the model's (or, with checkpointing, each checkpointed block's) forward compiled in place
  (``Module.compile``: the state_dict keys stay); its communication is the custom operators of
  :mod:`mpidomain.nn.ops`.
- **activation checkpointing**: non-reentrant ``torch.utils.checkpoint`` around the blocks CREDIT marks for it
  (``_fsdp2_shard``: what CREDIT's ``trainer.activation_checkpoint`` wraps), else around the whole model; the
  forward runs again in backward, its exchanges with it, alike on every rank. The recomputation starts from
  the buffers the forward started from and leaves them as the forward left them, so a buffer the forward
  advances (spectral norm's ``weight_u`` and ``weight_v``, batch norm's running statistics) advances once per
  step, as without checkpointing. ``checkpoint_like_credit`` does exactly what CREDIT's gen2 trainer does
  instead: the marked blocks only (none where none is marked), each buffer advanced again in the
  recomputation (torch's ``checkpoint_wrapper`` as it is). With
  compile, each block is compiled inside its checkpoint (PyTorch 2.13 cannot checkpoint a region inside a
  compiled graph whose operators are ordered effects).
- **mixed precision**: ``torch.autocast`` (``"bf16"``; ``"fp16"`` with an :class:`AgreedGradScaler`, whose
  decision to skip a step with inf/NaN gradients is the same on every rank).
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .._current import require_manager
from ..reduce import allreduce

__all__ = ["AgreedGradScaler", "TrainingOptions", "TrainingSetup", "prepare_training"]

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainingOptions:
    """What :func:`prepare_training` switches on.

    :param compile: Compile the model with ``torch.compile`` (``compile_backend``; ``"aot_eager"`` compiles
        the graph without generating kernels).
    :param activation_checkpoint: Recompute activations in backward instead of keeping them.
    :param checkpoint_like_credit: With ``activation_checkpoint``, checkpoint as CREDIT's gen2 trainer
        (``credit.parallel.fsdp2._apply_activation_checkpointing``): only the blocks marked ``_fsdp2_shard``,
        nothing where none is, and the recomputation advancing buffers again (``credit train``'s choice, so
        that it equals CREDIT's run). Default: the marked blocks or else the whole model, buffers advanced
        once per step.
    :param amp: None (the model's dtype), ``"bf16"`` or ``"fp16"`` (``torch.autocast``; fp16 with a scaler).
    :param compile_backend: The ``torch.compile`` backend.
    """

    compile: bool = False
    activation_checkpoint: bool = False
    checkpoint_like_credit: bool = False
    amp: Optional[str] = None
    compile_backend: str = "inductor"

    def __post_init__(self):
        for name in ("compile", "activation_checkpoint", "checkpoint_like_credit"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TrainingOptions({name}=...) takes True or False, got {getattr(self, name)!r}")
        if self.amp not in (None, *AMP_DTYPES):
            raise ValueError(f"TrainingOptions(amp=...) takes None, 'bf16' or 'fp16', got {self.amp!r}")
        if not isinstance(self.compile_backend, str):
            raise TypeError(f"TrainingOptions(compile_backend=...) takes a backend name such as 'inductor', got "
                            f"{self.compile_backend!r}")

    def summary(self):
        """One phrase for a summary line: ``"compile, activation checkpoint, amp bf16"``, or ``"eager"``."""
        parts = (["compile"] if self.compile else []) + (["activation checkpoint"] if self.activation_checkpoint
                                                          else []) + ([f"amp {self.amp}"] if self.amp else [])
        return ", ".join(parts) or "eager"


@dataclass(frozen=True)
class TrainingSetup:
    """What the training loop uses (:func:`prepare_training`)::

        setup = prepare_training(model, TrainingOptions(compile=True, amp="bf16"), manager=manager)
        with setup.autocast():
            loss = loss_function(setup.model(x), y)
        setup.backward(loss)                      # scaled by the scaler, if any
        allreduce_gradients(model, group="domain", op="sum")
        allreduce_gradients(model, group="data_parallel")
        setup.step(optimizer)                     # optimizer.step(), or the scaler's agreed step and update

    ``model``: the module to call (the model itself, compiled in place, or a checkpoint wrapper around it;
    the state_dict keys are the model's); ``autocast``: a function returning a fresh context manager
    (``contextlib.nullcontext`` without amp); ``scaler``: an :class:`AgreedGradScaler` (fp16) or None;
    ``blocks``: the paths of the checkpointed blocks ("" for the whole model).
    """

    model: torch.nn.Module
    autocast: Callable[[], Any]
    scaler: Optional["AgreedGradScaler"]
    options: TrainingOptions
    blocks: tuple = ()

    def backward(self, loss):
        """``loss.backward()``, through the scaler if there is one. Collective like the model's backward."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer):
        """``optimizer.step()``; with a scaler, its step (skipped alike on every rank) and update. Collective."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()


class AgreedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose inf/NaN check is agreed over the manager's ranks, domain and data-parallel.

    Each rank holds its own shard's part of the gradients (or, before the gradient all-reduces, its own
    partial sums), so an overflow can show on some ranks only; ``unscale_`` (which ``step`` calls) and the check
    a fused optimizer's ``step`` runs instead (``fused=True``) all-reduce the found-inf flag (max) over every
    rank of the manager, so every rank skips the same steps and backs off its scale alike. Collective over the manager's ranks: every rank calls ``unscale_``/``step`` for the
    same optimizers in the same order.

    :param device: As for ``torch.amp.GradScaler`` (``"cuda"``, ``"cpu"``).
    :param manager: Default: the global manager from ``initialize_domain_parallel``.
    :param kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``.
    """

    def __init__(self, device="cuda", *, manager=None, **kwargs):
        super().__init__(device, **kwargs)
        self._domain_manager = require_manager(manager, "AgreedGradScaler")

    def unscale_(self, optimizer):
        """Unscale ``optimizer``'s gradients; the found-inf flag is the max over every rank. Collective."""
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(optimizer)

    def _check_inf_per_device(self, optimizer):
        """The inf/NaN check a fused optimizer's ``step`` runs instead of ``unscale_``: agreed alike. Collective."""
        super()._check_inf_per_device(optimizer)
        self._agree(optimizer)
        return self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def _agree(self, optimizer):
        """Make ``optimizer``'s found-inf flags the max over every rank of the manager. Collective."""
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        mine = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in found.values():
            mine = torch.maximum(mine, flag.to(mine.device))
        agreed = allreduce(mine, "max", self._domain_manager.library_comm("world"))
        for device in list(found):
            found[device] = agreed.to(found[device].device)
        if not found:  # no gradient on this rank: it skips with the others all the same
            found[self._scale.device] = agreed


def checkpoint_blocks(model, unmarked=True):
    """Return ``[(path, module)]`` of the blocks :func:`prepare_training` checkpoints: the outermost modules
    CREDIT marks for it (``_fsdp2_shard``), else ``[("", model)]`` (the whole model) or, with
    ``unmarked=False``, ``[]``. Local."""
    found, covered = [], []
    for path, module in model.named_modules():
        if any(path.startswith(c + ".") for c in covered):
            continue
        if path and getattr(module, "_fsdp2_shard", False):
            found.append((path, module))
            covered.append(path)
    return found or ([("", model)] if unmarked else [])


class _ForwardBuffers:
    """The forward's context of a checkpointed block: keeps the values of the buffers the forward changes."""

    def __init__(self, module):
        self.buffers = list(module.buffers())
        self.before = None

    def __enter__(self):
        self.versions = [b._version for b in self.buffers]
        self.before = [b.detach().clone() for b in self.buffers]

    def __exit__(self, *exc):  # only what the forward changed stays until the backward (a kernel may update a
        # buffer without bumping its version, as batch norm's running statistics on some paths: compared too)
        self.before = [(b, value) for b, value, version in zip(self.buffers, self.before, self.versions)
                       if b._version != version or not torch.equal(b, value)]


class _RecomputeBuffers:
    """The recomputation's context: the changed buffers as the forward found them, then as it left them."""

    def __init__(self, forward):
        self.forward = forward

    @torch.no_grad()
    def __enter__(self):
        self.after = [(b, b.detach().clone()) for b, _ in self.forward.before]
        for b, value in self.forward.before:
            b.copy_(value)

    @torch.no_grad()
    def __exit__(self, *exc):  # also when the recomputation stops early (torch's early stop)
        for b, value in self.after:
            b.copy_(value)


def _buffer_contexts(module):
    """``context_fn`` for ``torch.utils.checkpoint``: buffers advanced once per step, not again in backward."""
    def contexts():
        forward = _ForwardBuffers(module)
        return forward, _RecomputeBuffers(forward)
    return contexts


def _checkpointed(module, like_credit=False):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    if like_credit:
        return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return checkpoint_wrapper(module, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                              context_fn=_buffer_contexts(module))


def _replace(model, path, new):
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


def prepare_training(model, options=TrainingOptions(), *, manager=None):
    """Return the :class:`TrainingSetup` of converted ``model`` with ``options`` switched on.

    Local (compiling and wrapping communicate nothing; the compiled model's first call, collective like
    every call, traces it on every rank together). Changes ``model`` in place: its forward compiled
    (``Module.compile``) and its checkpointed blocks wrapped (their parameters and state_dict keys are
    the model's own); the returned ``setup.model`` is what to call. Do it alike on every rank.

    :param model: The converted model (``convert_to_domain_parallel``), on its device.
    :param options: A :class:`TrainingOptions`.
    :param manager: For the fp16 scaler's agreement; default the global manager.
    """
    if not isinstance(options, TrainingOptions):
        raise TypeError(f"prepare_training takes a TrainingOptions, got {type(options).__name__}; build one, e.g. "
                        "TrainingOptions(compile=True, amp='bf16')")
    compile_block = functools.partial(_compile, backend=options.compile_backend)
    blocks = ()
    if options.activation_checkpoint:
        found = checkpoint_blocks(model, unmarked=not options.checkpoint_like_credit)
        blocks = tuple(path for path, _ in found)
        for path, module in found:
            if options.compile:
                compile_block(module)
            if path:
                _replace(model, path, _checkpointed(module, options.checkpoint_like_credit))
        if not found and options.compile:
            compile_block(model)
        if found and not found[0][0]:
            model = _checkpointed(model)
    elif options.compile:
        compile_block(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    autocast, scaler = contextlib.nullcontext, None
    if options.amp is not None:
        autocast = functools.partial(torch.autocast, device.type, dtype=AMP_DTYPES[options.amp])
        if options.amp == "fp16":
            scaler = AgreedGradScaler(device.type, manager=manager)
    return TrainingSetup(model, autocast, scaler, options, blocks)


def _compile(module, backend):
    module.compile(backend=backend)

"""What one forecast job does: :class:`ForecastSettings`, checked before any rank starts work."""

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .._validate import RNG_MODES
from ..command import Requirement
from ..preemption import signal_number

__all__ = ["AMP", "ForecastSettings", "MODELS", "DTYPES", "requirements"]

MODELS = ("auto", "cnn", "crossformer")
MAX_SEED = 2**32 - 1  # torch's and NumPy's seeds both take it
DTYPES = ("float32", "float64")
AMP = ("bf16",)


@dataclass(frozen=True)
class ForecastSettings:
    """The settings of ``python -m mpidomain forecast`` (its options, one field each).

    :param data: Zarr store to train on and verify against; None writes a synthetic ERA5-like one in ``out``.
    :param variables: Variables of the store to model (None: every variable on the latitude x longitude grid).
    :param domain: Ranks per domain group (latitude slabs) or ``(D_lat, D_lon)`` tiles; the rest of the
        ranks are data-parallel groups.
    :param steps: Training steps in all (a resumed run continues up to it).
    :param train_rollout: Steps of the rollout the last third of the training steps backpropagates through.
    :param rollout: Steps of the forecast written at the end.
    :param batch: Samples per training step over all data-parallel groups (each group takes batch / groups).
    :param out: Folder for the synthetic store, the checkpoint and the forecast (None: a temporary folder).
    :param plot: PNG to draw (the loss curve, a forecast field next to the truth), or None.
    :param model: ``cnn`` (the built-in U-Net), ``crossformer`` (CREDIT's) or ``auto`` (CREDIT's where installed).
    :param dtype: ``float32`` or ``float64`` (the model, the samples and the arithmetic).
    :param grid: Latitudes x longitudes of the synthetic store.
    :param times: Time steps of the synthetic store.
    :param lr: Adam's learning rate.
    :param seed: Seed of the model's weights and of the samples each step draws.
    :param resume: Checkpoint to continue training from (at any layout of ranks), or ``"auto"``: the newest
        complete checkpoint in ``out`` (none: start fresh).
    :param stop_after: Stop after this training step, with a checkpoint, before the forecast.
    :param estimate: Print the predicted activation memory per rank for this layout and stop.
    :param checkpoint_every: Also save a checkpoint after every this many training steps (None: only at the end,
        at ``stop_after`` and on a stop signal).
    :param keep: How many numbered checkpoints to keep in ``out`` (the newest).
    :param stop_signals: Signals that stop the run cleanly at the next step boundary, with a checkpoint.
    :param skip_nan: Skip a training step whose samples are not finite (else: stop with an error); a loss that is
        not finite from finite samples always stops the run (the model diverged).
    :param compile: Train with the model compiled (``torch.compile``; the forecast's model too).
    :param activation_checkpoint: Recompute the model's activations in backward instead of keeping them.
    :param amp: ``"bf16"``: train under ``torch.autocast`` to bfloat16 (``--dtype float32`` only); None: the
        model's dtype.
    :param compile_backend: ``torch.compile``'s backend with ``compile`` (no option: ``"aot_eager"`` compiles
        without generating kernels, for tests).
    :param rng: How the converted model's random layers draw: ``"tile"`` or ``"one-process"``
        (:mod:`mpidomain.nn.rng`).
    """

    data: Optional[str] = None
    variables: Optional[Tuple[str, ...]] = None
    domain: Union[int, Tuple[int, int], None] = None
    steps: int = 30
    train_rollout: int = 2
    rollout: int = 4
    batch: int = 4
    out: Optional[str] = None
    plot: Optional[str] = None
    model: str = "auto"
    dtype: str = "float32"
    grid: Tuple[int, int] = (64, 128)
    times: int = 40
    lr: float = 1e-3
    seed: int = 0
    resume: Optional[str] = None
    stop_after: Optional[int] = None
    estimate: bool = False
    checkpoint_every: Optional[int] = None
    keep: int = 3
    stop_signals: Tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    skip_nan: bool = False
    compile: bool = False
    activation_checkpoint: bool = False
    amp: Optional[str] = None
    compile_backend: str = "inductor"
    rng: str = "tile"

    def problems(self, world_size):
        """Return what is wrong with these settings for ``world_size`` ranks, one line each (empty: fine)."""
        found = []
        for name in ("steps", "train_rollout", "rollout", "batch", "times", "keep"):
            if getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            found.append(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.rng not in RNG_MODES:
            found.append(f"--rng must be one of {', '.join(RNG_MODES)}, got {self.rng!r}")
        if not 0 <= self.seed <= MAX_SEED:
            found.append(f"--seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.variables is not None and len(set(self.variables)) != len(self.variables):
            found.append(f"--variables names a variable twice: {','.join(self.variables)}")
        if self.resume is not None and not self.resume:
            found.append("--resume must name a checkpoint file, or auto")
        if self.resume == "auto" and self.out is None:
            found.append("--resume auto continues the run whose checkpoints are in --out: give --out")
        if min(self.grid) < 1:
            found.append(f"--grid must be two positive extents, got {'x'.join(map(str, self.grid))}")
        shape = self.domain_shape(world_size)
        if min(shape) < 1:
            found.append(f"-D must be a positive rank count or positive tiles such as 2x2, got {self.domain_text(world_size)}")
            return found
        if self.model not in MODELS:
            found.append(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.dtype not in DTYPES:
            found.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.amp is not None and self.amp not in AMP:
            found.append(f"--amp must be one of {', '.join(AMP)}, got {self.amp!r}")
        elif self.amp is not None and self.dtype != "float32":
            found.append(f"--amp {self.amp} autocasts a float32 model; --dtype {self.dtype} is not autocast: use "
                         "--dtype float32 or leave out --amp")
        if not (math.isfinite(self.lr) and self.lr > 0):
            found.append(f"--lr must be a finite number > 0, got {self.lr}")
        for name in self.stop_signals:
            try:
                signal_number(name)
            except ValueError as error:
                found.append(f"--stop-signals: {error}")
        need = self.rollout + self.train_rollout + 2
        if self.data is None and self.times < need:
            found.append(f"--times {self.times} is too short: training on {self.train_rollout}-step rollouts and a "
                         f"{self.rollout}-step forecast need at least {need} time steps; raise --times or lower "
                         "--rollout / --train-rollout")
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            found.append(f"--stop-after must be between 1 and --steps {self.steps}, got {self.stop_after}")
        d = self.domain_size(world_size)
        if world_size % d:
            found.append(f"-D {self.domain_text(world_size)} needs a number of ranks it divides, got {world_size} ranks; "
                         f"run with a multiple of {d} ranks or choose another -D")
        elif self.batch % (world_size // d):
            found.append(f"--batch {self.batch} must split evenly over the {world_size // d} data-parallel groups "
                         f"({world_size} ranks / D={d}); use a multiple of {world_size // d}")
        return found

    def domain_size(self, world_size):
        """Ranks per domain group: the product of ``domain``, or the default for ``world_size`` ranks."""
        d = self.domain_shape(world_size)
        return d[0] * (d[1] if len(d) == 2 else 1)

    def domain_shape(self, world_size):
        """``(D,)`` slabs or ``(D_lat, D_lon)`` tiles; by default 2 slabs where the ranks are even, else 1."""
        if self.domain is None:
            return (2,) if world_size % 2 == 0 else (1,)
        return tuple(self.domain) if isinstance(self.domain, tuple) else (self.domain,)

    def domain_text(self, world_size):
        """The layout as -D spells it: ``4`` or ``2x2``."""
        return "x".join(str(d) for d in self.domain_shape(world_size))


def requirements(settings):
    """Return ``(required, optional)``: the :class:`~mpidomain.command.Requirement` s of a run of ``settings``.

    Optional ones only add comfort (the progress bar: plain lines without it).
    """
    required = [Requirement("torch", "python -m mpidomain forecast (the model)", "pip install torch"),
                Requirement("xarray", "python -m mpidomain forecast (reading and writing stores)", "pip install xarray"),
                Requirement("zarr", "python -m mpidomain forecast (reading and writing stores)", "pip install 'zarr>=3.1.5'",
                            minimum="3.1.5")]
    if settings.plot:
        required.append(Requirement("matplotlib", f"--plot {settings.plot}", "pip install matplotlib"))
    return required, [Requirement("tqdm", "the progress bar", "pip install tqdm")]

"""Command line: ``python -m mpidomain info|check|demo|forecast|credit`` under any launcher.

``info`` prints every rank's place in the domain-parallel mesh; ``check`` tests a
cluster end to end (halo exchange, shard/gather, link bandwidth, devices) and exits
0 with a one-line verdict, or 1 naming what failed on which ranks; ``demo`` trains a
small U-Net domain-parallel next to the same steps on one process and exits 0 if
the two models agree; ``forecast`` runs the whole job from disk to disk (a
synthetic ERA5-like store by default): trains domain x data parallel, saves and
resumes a checkpoint, forecasts, writes the forecast by tile and scores it; ``credit
train`` and ``credit rollout`` run a CREDIT gen2 config's training and forecasts.
"""

import argparse
import math
import sys
import warnings

from . import binding
from .cli import check, info
from ._errors import rank_ranges
from ._mpi import mpi
from .command import Requirement, UsageError, add_rng_option, positive_int, require, run_command
from .credit.command import add_commands as add_credit_commands, run as run_credit
from .manager import initialize_domain_parallel, library_comm


def _common(parser):
    parser.add_argument(
        "--domain-parallel-size", "-D", type=_domain_size, default=None, metavar="D|DLATxDLON",
        help="ranks per domain group, or latitude x longitude tiles such as 2x2 (default: all ranks of a "
             "tensor-parallel replica in one group of latitude slabs)",
    )
    parser.add_argument(
        "--tensor-parallel-size", "-T", type=positive_int, default=1,
        help="ranks per tensor-parallel group (default: 1); T x D must divide the number of ranks",
    )
    parser.add_argument(
        "--bind-device", type=_device_policy, default="auto", metavar="auto|none|0,1,...",
        help="GPU per rank: node-local rank modulo the GPU count (auto), leave it (none), "
             "or one device index per node-local rank",
    )


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser that prints usage, help and errors once: every rank parses the same command line."""

    def _print_message(self, message, file=None):
        if mpi().COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)

    def error(self, message):
        """Exit with status 2 and one line naming the mistake."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser():
    parser = _Parser(prog="python -m mpidomain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _common(commands.add_parser("info", help="print every rank's place in the domain-parallel mesh"))
    test = commands.add_parser("check", help="check halo exchange, shard/gather, link bandwidth and devices")
    _common(test)
    test.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                      help="where the test arrays live (default: cuda if every rank has a GPU, else cpu)")
    test.add_argument("--shape", type=_shape, default=None, metavar="B,C,H,W",
                      help="global array shape, sharded along H (default: 1,32,16*D,1440)")
    test.add_argument("--halo-width", type=positive_int, default=2, help="ghost rows on each side (default: 2)")
    test.add_argument("--repeats", type=positive_int, default=20,
                      help="round trips per bandwidth measurement (default: 20)")
    demo = commands.add_parser("demo", help="train a small U-Net domain-parallel and on one process; compare")
    demo.add_argument("--domain-parallel-size", "-D", type=_domain_size, default=2, metavar="D|DLATxDLON",
                      help="ranks per domain group, or latitude x longitude tiles such as 2x2 (default: 2)")
    demo.add_argument("--steps", type=positive_int, default=5, help="training steps (default: 5)")
    demo.add_argument("--size", type=_size, default=(128, 256), metavar="HxW",
                      help="latitudes x longitudes of the synthetic fields (default: 128x256)")
    _forecast_options(commands.add_parser(
        "forecast", help="train, checkpoint, forecast and score from a Zarr store (a synthetic one by default)",
        description="Train a model domain x data parallel on a Zarr store (by default a small synthetic ERA5-like "
                    "one made on the spot), with multi-step rollout fine-tuning; save a checkpoint; forecast from it; "
                    "write the forecast by tile; print the latitude-weighted RMSE per channel and one summary line."))
    credit = commands.add_parser(
        "credit", help="a CREDIT gen2 config's training and forecasts, domain-parallel (train, rollout)",
        description="Run a CREDIT gen2 config's job domain-parallel: train (equal to CREDIT's credit train in one "
                    "process) or rollout (CREDIT's output files, written from tiles).")
    add_credit_commands(credit.add_subparsers(dest="credit_command", required=True, parser_class=_Parser))
    return parser


def _forecast_options(parser):
    defaults = _forecast_defaults()
    parser.add_argument("--data", metavar="PATH", help="Zarr store with time x [level x] latitude x longitude "
                        "variables (default: write a synthetic ERA5-like store in --out)")
    parser.add_argument("--variables", type=_names, metavar="A,B,...",
                        help="variables of the store to model (default: all with dims time, [level,] latitude, "
                             "longitude)")
    parser.add_argument("--domain-parallel-size", "-D", type=_domain_size, default=None, metavar="D|DLATxDLON",
                        help="ranks per domain group, or tiles such as 2x2; the other ranks form data-parallel "
                             "groups (default: 2 where the ranks are even, else 1)")
    parser.add_argument("--steps", type=positive_int, default=defaults.steps,
                        help=f"training steps; the last third trains on rollouts (default: {defaults.steps})")
    parser.add_argument("--train-rollout", type=positive_int, default=defaults.train_rollout, metavar="K",
                        help=f"rollout steps of the fine-tuning (default: {defaults.train_rollout})")
    parser.add_argument("--rollout", type=positive_int, default=defaults.rollout, metavar="K",
                        help=f"forecast steps (default: {defaults.rollout})")
    parser.add_argument("--batch", type=positive_int, default=defaults.batch,
                        help=f"samples per step over all data-parallel groups (default: {defaults.batch})")
    parser.add_argument("--out", metavar="PATH", help="folder for the synthetic store, checkpoints and forecast, made "
                        "if missing (default: a new temporary folder)")
    parser.add_argument("--plot", metavar="PNG", help="draw the loss curve and a forecast field beside the truth "
                        "(needs matplotlib)")
    parser.add_argument("--model", choices=("auto", "cnn", "crossformer"), default=defaults.model,
                        help="CREDIT's CrossFormer, the built-in U-Net, or auto: CrossFormer where CREDIT is "
                             "installed (default: auto)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=defaults.dtype,
                        help=f"precision of the model and samples (default: {defaults.dtype})")
    parser.add_argument("--grid", type=_size, default=defaults.grid, metavar="HxW",
                        help="latitudes x longitudes of the synthetic store (default: %s)" % "x".join(
                            map(str, defaults.grid)))
    parser.add_argument("--times", type=positive_int, default=defaults.times,
                        help=f"time steps of the synthetic store (default: {defaults.times})")
    parser.add_argument("--lr", type=_learning_rate, default=defaults.lr,
                        help=f"Adam's learning rate (default: {defaults.lr})")
    parser.add_argument("--seed", type=_seed, default=defaults.seed,
                        help="seed of the weights and the samples drawn (default: 0)")
    parser.add_argument("--resume", type=_checkpoint, metavar="CHECKPOINT|auto",
                        help="continue training from a checkpoint (any -D), or auto: the newest complete one in --out "
                             "(none: start fresh); a forecast store left by a stopped run is completed")
    parser.add_argument("--checkpoint-every", type=positive_int, metavar="N",
                        help="also save a checkpoint every N training steps (default: at the end, at --stop-after "
                             "and on a stop signal)")
    parser.add_argument("--keep", type=positive_int, default=defaults.keep, metavar="K",
                        help=f"numbered checkpoints to keep in --out, the newest (default: {defaults.keep})")
    parser.add_argument("--stop-signals", type=_signals, default=defaults.stop_signals, metavar="SIG,...",
                        help="signals that stop training cleanly at the next step boundary with a checkpoint "
                             f"(default: {','.join(defaults.stop_signals)})")
    parser.add_argument("--skip-nan", action="store_true",
                        help="skip a training step whose samples are not finite (default: stop, naming the "
                             "variable, time and step); a loss that is not finite from finite samples always stops")
    parser.add_argument("--stop-after", type=positive_int, metavar="STEP",
                        help="stop after this training step with a checkpoint (resume later with --resume)")
    parser.add_argument("--estimate", action="store_true",
                        help="print the predicted activation memory per rank for this layout, then stop")
    _training_stack_options(parser)
    add_rng_option(parser)


def _training_stack_options(parser):
    """--compile, --activation-checkpoint, --amp: what mpidomain.nn.training switches on (forecast, credit)."""
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with torch.compile (the library's communication as custom operators)")
    parser.add_argument("--activation-checkpoint", action="store_true",
                        help="recompute activations in backward instead of keeping them (less memory, more compute)")
    parser.add_argument("--amp", choices=("bf16",), default=None,
                        help="train under torch.autocast to bfloat16 (float32 models; default: the model's dtype)")


def _forecast_defaults():
    from .forecast.settings import ForecastSettings  # no torch: the settings are plain data

    return ForecastSettings()


def _learning_rate(text):
    """Parse a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0 such as 1e-3, got {text!r}")
    return value


def _signals(text):
    """Parse --stop-signals: comma-separated signal names, e.g. SIGTERM,SIGUSR1."""
    from .preemption import signal_number

    names = tuple(n.strip().upper() for n in text.split(",") if n.strip())
    try:
        for name in names:
            signal_number(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))
    if not names:
        raise argparse.ArgumentTypeError(f"expected signal names such as SIGTERM,SIGUSR1, got {text!r}")
    return tuple(n if n.startswith("SIG") or n.isdigit() else f"SIG{n}" for n in names)


def _names(text):
    """Parse --variables: comma-separated names, each once."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct variable names such as t,u,t2m, got {text!r}")
    return names


def _seed(text):
    """Parse --seed: an int from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 2**32 - 1:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to {2**32 - 1}, got {text!r}")
    return value


def _checkpoint(text):
    """Parse --resume: a path, or auto."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a checkpoint file or auto, got ''")
    return text


def _device_policy(text):
    """Parse --bind-device: 'auto', 'none' or comma-separated device indices."""
    if text in ("auto", "none"):
        return text
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        indices = [-1]
    if min(indices) < 0:
        raise argparse.ArgumentTypeError(f"expected auto, none or device indices >= 0 such as 0,1,2,3, got {text!r}")
    return indices


def _shape(text):
    """Parse --shape: four comma-separated positive extents, B,C,H,W."""
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"expected four positive extents B,C,H,W (batch, channels, latitude, longitude) such as 1,32,64,1440, "
            f"got {text!r}")
    return shape


def _domain_size(text):
    """Parse -D: an int (latitude slabs) or DLATxDLON (tiles), e.g. 4 or 2x2."""
    try:
        parts = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        parts = ()
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive rank count such as 4 or positive tiles such as 2x2, "
                                         f"got {text!r}")
    return parts[0] if len(parts) == 1 else parts


def _size(text):
    """Parse --size: HxW, two positive extents."""
    try:
        size = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise argparse.ArgumentTypeError(f"expected latitudes x longitudes such as 128x256, got {text!r}")
    return size


def _demo(args):
    require("demo", [Requirement("torch", "python -m mpidomain demo", "pip install torch")])
    from .cli.demo import run_demo  # imports torch

    return run_demo(args.steps, args.domain_parallel_size, args.size, out=lambda line: print(line, flush=True))


def _forecast(args):
    from .forecast.settings import ForecastSettings, requirements

    settings = ForecastSettings(
        data=args.data, variables=args.variables, domain=args.domain_parallel_size, steps=args.steps,
        train_rollout=args.train_rollout, rollout=args.rollout, batch=args.batch, out=args.out, plot=args.plot,
        model=args.model, dtype=args.dtype, grid=args.grid, times=args.times, lr=args.lr, seed=args.seed,
        resume=args.resume, stop_after=args.stop_after, estimate=args.estimate, checkpoint_every=args.checkpoint_every,
        keep=args.keep, stop_signals=args.stop_signals, skip_nan=args.skip_nan, compile=args.compile,
        activation_checkpoint=args.activation_checkpoint, amp=args.amp, rng=args.rng)
    required, optional = requirements(settings)
    require("forecast", required, optional=optional)  # before the job's modules import them
    from .forecast.job import run_forecast

    return run_forecast(settings, out=lambda line: print(line, flush=True))


def _manager(args, size):
    """The global manager for a command; the GPU libraries are imported first so that it binds."""
    binding._find_devices(import_libraries=True)
    t = args.tensor_parallel_size
    d = (size // t if t >= 1 and size % t == 0 else size) if args.domain_parallel_size is None else args.domain_parallel_size
    return initialize_domain_parallel(size, d, (-2, -1) if isinstance(d, tuple) else -2, tensor_parallel_size=t,
                                      bind_device=args.bind_device)


def _info(args):
    manager = _manager(args, mpi().COMM_WORLD.Get_size())
    rows = info.gather_layout(manager)
    if manager.rank == 0:
        print(info.format_layout(manager, rows), flush=True)
    manager.close()
    return 0


def _check(args):
    with warnings.catch_warnings():  # check reports GPU sharing itself
        warnings.simplefilter("ignore", RuntimeWarning)
        manager = _manager(args, mpi().COMM_WORLD.Get_size())
    d, d_lon = (manager.domain_shape if manager.tiled else (manager.domain_parallel_size, 1))
    shape = args.shape or (1, 32, 16 * d, 1440)
    tiles = manager.tiled
    for what, n, parts in (("rows", shape[-2], d), ("columns", shape[-1], d_lon)):
        if n // parts < args.halo_width:
            over = f"{parts} tiles" if tiles else f"D={parts} ranks"
            raise UsageError(
                f"--shape {','.join(map(str, shape))}: {n} {what} over {over} leaves some with "
                f"{n // parts}, fewer than --halo-width {args.halo_width}; use at least {parts * args.halo_width} "
                f"{what}"
            )
    has_gpu = library_comm(manager, "world").allgather(manager.device_binding is not None and manager.device_binding.device is not None)
    device = args.device
    if device == "auto":
        device = "cuda" if all(has_gpu) else "cpu"
    elif device == "cuda" and not all(has_gpu):
        missing = [rank for rank, ok in enumerate(has_gpu) if not ok]
        raise UsageError(
            f"--device cuda, but ranks {rank_ranges(missing)} have no CUDA device bound (torch or cupy with a GPU, "
            "and --bind-device not none); use --device cpu, or check the nodes' GPUs and CUDA_VISIBLE_DEVICES"
        )
    status = check.run_check(manager, device, shape, args.halo_width, args.repeats)
    manager.close()
    return status


def main(argv=None):
    """Run the command line; return the process exit status (the same on every rank)."""
    args = _parser().parse_args(argv)
    commands = {"info": _info, "check": _check, "demo": _demo, "forecast": _forecast, "credit": run_credit}
    name = f"credit {args.credit_command}" if args.command == "credit" else args.command
    return run_command(name, lambda: commands[args.command](args))


if __name__ == "__main__":
    sys.exit(main())

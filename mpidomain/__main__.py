"""Command line: ``python -m mpidomain info`` under any launcher."""

import argparse
import sys

from . import binding, info
from ._mpi import mpi
from .manager import initialize_domain_parallel


def _parser():
    parser = argparse.ArgumentParser(prog="python -m mpidomain", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("info", help="print every rank's place in the domain-parallel mesh")
    show.add_argument(
        "--domain-parallel-size", "-D", type=int, default=None,
        help="ranks per domain group (default: all ranks in one group)",
    )
    show.add_argument(
        "--bind-device", type=_device_policy, default="auto", metavar="auto|none|0,1,...",
        help="GPU per rank: node-local rank modulo the GPU count (auto), leave it (none), "
             "or one device index per node-local rank",
    )
    return parser


def _device_policy(text):
    """Parse --bind-device: 'auto', 'none' or comma-separated device indices."""
    if text in ("auto", "none"):
        return text
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, none or device indices such as 0,1,2,3, got {text!r}")


def _manager(args, size):
    """The global manager for a command; the GPU libraries are imported first so that it binds."""
    binding._find_devices(import_libraries=True)
    return initialize_domain_parallel(size, args.domain_parallel_size or size, bind_device=args.bind_device)


def _info(args):
    world = mpi().COMM_WORLD
    size = world.Get_size()
    manager = _manager(args, size)
    rows = info.gather_layout(manager)
    if manager.rank == 0:
        print(info.format_layout(manager, rows), flush=True)
    manager.close()
    return 0


def main(argv=None):
    """Run the command line; return the process exit status."""
    args = _parser().parse_args(argv)
    try:
        return {"info": _info}[args.command](args)
    except (ValueError, TypeError, RuntimeError) as error:
        # Raised on every rank alike (mpidomain's collective checks): report once.
        if mpi().COMM_WORLD.Get_rank() == 0:
            print(f"python -m mpidomain {args.command}: error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

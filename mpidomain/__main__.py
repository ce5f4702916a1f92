"""Command line: ``python -m mpidomain info`` under any launcher."""

import argparse
import sys

from . import info
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
    return parser


def _info(args):
    world = mpi().COMM_WORLD
    size = world.Get_size()
    manager = initialize_domain_parallel(size, args.domain_parallel_size or size)
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

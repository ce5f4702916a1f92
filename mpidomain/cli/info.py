"""Describe the running job: one table of every rank's place in the mesh."""

import importlib.util
import socket

from .._mpi import mpi
from ..devices import cuda_aware_decision
from ..manager import library_comm

__all__ = ["cuda_visible", "gather_layout", "format_layout"]


def cuda_visible():
    """Return a short string saying whether (and how many) CUDA devices this process sees."""
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return f"yes ({torch.cuda.device_count()} via torch)"
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            if count:
                return f"yes ({count} via cupy)"
        except Exception:  # no driver, no device: cupy raises its own runtime errors
            pass
    return "no"


def _device(binding):
    if binding is None or binding.device is None:
        return "-"
    return binding.describe().replace(", shared with ", ",shared:").replace(" ", "")


def _row(manager):
    prev_rank, next_rank = manager.neighbor_ranks()
    return {
        "rank": manager.rank,
        "host": socket.gethostname(),
        "local": f"{manager.local_rank}/{manager.local_size}",
        "node": manager.node_index,
        "dp": manager.dp_rank,
        "tp": manager.tp_rank,
        "domain": manager.domain_rank,
        **({"tile": "({},{})".format(*manager.domain_coords)} if manager.tiled else {}),
        "domain group": manager.mesh.group_index("domain"),
        "prev": "-" if prev_rank is None else prev_rank,
        "next": "-" if next_rank is None else next_rank,
        "cuda": cuda_visible(),
        "device": _device(manager.device_binding),
        "launcher rank": manager.launcher.rank,
    }


def gather_layout(manager, root=0, extra=None):
    """Gather every rank's row of the layout table to ``root``.

    Collective over ``manager.comm``: call on all ranks. ``extra`` is a dict of
    further columns for this rank. Returns the list of rows on ``root``, None
    elsewhere.
    """
    row = _row(manager)
    row.update(extra or {})
    return library_comm(manager, "world").gather(row, root=root)


def format_layout(manager, rows, header_extra=()):
    """Return the printable report: a header, then one line per rank."""
    MPI = mpi()
    library = MPI.Get_library_version().strip().splitlines()[0]
    mesh = manager.mesh
    cuda = sorted({row["cuda"] for row in rows})

    def groups(axis):
        return " ".join(str(g).replace(" ", "") for g in mesh.groups(axis))

    lines = [
        f"world size        : {manager.world_size} ({manager.num_nodes} node(s))",
        f"launcher          : {manager.launcher.describe()}",
        f"MPI library       : {library} (MPI {'.'.join(map(str, MPI.Get_version()))})",
        f"mpi4py            : {__import__('mpi4py').__version__}",
        f"mesh              : (dp, tp, domain) = {mesh.shape}, domain innermost",
        f"domain parallel   : D={manager.domain_parallel_size}, shard_dim={manager.shard_dim}"
        + (f", {manager.domain_shape[0]} x {manager.domain_shape[1]} latitude x longitude tiles (domain rank = "
           f"i_lat * {manager.domain_shape[1]} + i_lon; prev/next: the tiles north and south)"
           if manager.tiled else ", latitude slabs" if manager.shard_dim == -2 else ""),
        f"tensor parallel   : T={manager.tensor_parallel_size}",
        f"domain groups     : {groups('domain')}",
        f"tensor-par. grps  : {groups('tp')}",
        f"data-parallel grps: {groups('dp')}",
        f"CUDA visible      : {', '.join(cuda)}",
        f"device buffers    : {cuda_aware_decision()}",
    ]
    lines.extend(header_extra)
    columns = [c for c in rows[0] if c != "cuda"]
    table = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(columns)]
    lines.append("")
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.extend("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in table)
    return "\n".join(lines)


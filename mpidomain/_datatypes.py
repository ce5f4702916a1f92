"""MPI datatypes for blocks of C-contiguous arrays: raw-byte messages, subarrays and their structs.

Local: building a datatype communicates nothing. Each committed datatype
returned here belongs to the caller, who frees it.
"""

from . import devices
from ._mpi import mpi

__all__ = ["block_shape", "message", "subarray", "struct_of_blocks"]


def message(buffer):
    """Return the MPI message of a contiguous buffer (host or device): its raw bytes."""
    return [devices.mpi_buffer(devices.byte_view(buffer)), mpi().BYTE]


def block_shape(shape, rows):
    """Return the shape of block ``rows`` (an index of slices, maybe shorter than ``shape``) of an array of ``shape``."""
    rows = tuple(rows) + (slice(None),) * (len(shape) - len(rows))
    return tuple(len(range(*s.indices(n))) for s, n in zip(rows, shape))


def subarray(shape, itemsize, rows):
    """Return the committed datatype of block ``rows`` of a C-contiguous array of ``shape``."""
    rows = tuple(rows) + (slice(None),) * (len(shape) - len(rows))
    starts = [s.indices(n)[0] for s, n in zip(rows, shape)]
    sizes, block = list(shape), list(block_shape(shape, rows))
    sizes[-1], block[-1], starts[-1] = sizes[-1] * itemsize, block[-1] * itemsize, starts[-1] * itemsize
    return mpi().BYTE.Create_subarray(sizes, block, starts).Commit()


def struct_of_blocks(shape, itemsize, blocks):
    """Return the committed datatype of ``blocks`` (each an index of slices) of a C-contiguous array of ``shape``,
    in order: one message carries them all."""
    types = [subarray(shape, itemsize, rows) for rows in blocks]
    if len(types) == 1:
        return types[0]
    joined = mpi().Datatype.Create_struct([1] * len(types), [0] * len(types), types).Commit()
    for datatype in types:
        datatype.Free()
    return joined


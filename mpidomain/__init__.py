"""mpidomain: MPI-backed, launcher-agnostic domain parallelism for NumPy, CuPy and PyTorch.

Importing the package does not start MPI; MPI initialises at the first call
that needs it, so a program can choose its GPU first.
"""

from .binding import DeviceBinding, bind_device
from .halo.plan import HaloPlan
from .halo.call import halo_exchange
from .launcher import Launcher, detect_launcher
from .manager import DomainParallelManager, get_domain_parallel_manager, initialize_domain_parallel
from .redistribution import redistribute
from .reduce import allreduce
from .sharding import balanced_split, gather_tensor, scatter_tensor, shard_batch, shard_tensor
from .torch_bridge import init_torch_distributed

__version__ = "0.1.0"

__all__ = [
    "DomainParallelManager",
    "initialize_domain_parallel",
    "get_domain_parallel_manager",
    "HaloPlan",
    "halo_exchange",
    "Launcher",
    "detect_launcher",
    "bind_device",
    "DeviceBinding",
    "shard_tensor",
    "gather_tensor",
    "scatter_tensor",
    "shard_batch",
    "balanced_split",
    "allreduce",
    "redistribute",
    "init_torch_distributed",
]

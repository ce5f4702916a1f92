"""Domain-parallel manager: the (data_parallel, domain_parallel) mesh over MPI.

Same API as NCAR CREDIT's ``credit.domain_parallel.manager``, but the groups
are MPI communicators built with ``Split`` on a duplicate of the parent
communicator, so it runs under any launcher (srun, mpiexec, mpirun, PALS) or
none. Domain groups are consecutive ranks; data-parallel groups stride by the
domain-parallel size. With 8 ranks and ``domain_parallel_size=2``::

    domain groups:        [0,1] [2,3] [4,5] [6,7]
    data-parallel groups: [0,2,4,6] [1,3,5,7]
"""

import logging
import warnings

from . import abort, binding
from . import torch_bridge as bridge
from ._mpi import check_same, forget_timeout, is_active, mpi, raise_on_all_ranks
from ._validate import is_int
from .launcher import check_launcher_world, detect_launcher

__all__ = ["DomainParallelManager", "initialize_domain_parallel", "get_domain_parallel_manager"]

logger = logging.getLogger(__name__)

_MANAGER = None


def _argument_error(world_size, domain_parallel_size, shard_dim, comm_size):
    """Return the first local problem with the arguments, or None."""
    if not is_int(world_size):
        return TypeError(f"world_size must be an int, got {world_size!r} ({type(world_size).__name__})")
    if not is_int(domain_parallel_size):
        return TypeError(
            f"domain_parallel_size must be an int, got {domain_parallel_size!r} "
            f"({type(domain_parallel_size).__name__})"
        )
    if not is_int(shard_dim):
        return TypeError(f"shard_dim must be an int, got {shard_dim!r} ({type(shard_dim).__name__})")
    if world_size != comm_size:
        return ValueError(
            f"world_size={world_size} but the communicator has {comm_size} ranks; pass "
            f"world_size={comm_size} (the launcher's process count, e.g. mpiexec -n {comm_size})"
        )
    if domain_parallel_size < 1:
        return ValueError(f"domain_parallel_size must be >= 1, got {domain_parallel_size}")
    if world_size % domain_parallel_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        return ValueError(
            f"domain_parallel_size={domain_parallel_size} does not divide world_size={world_size}; "
            f"choose one of {divisors} or launch a multiple of {domain_parallel_size} ranks"
        )
    return None


class DomainParallelManager:
    """Build and hold the domain-parallel and data-parallel communicators.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank must call
    it with the same arguments. A mistake seen on any rank raises the same
    ValueError or TypeError on every rank.

    :param world_size: Number of ranks in ``comm``.
    :param domain_parallel_size: Ranks per domain-parallel group (D).
    :param shard_dim: Spatial dimension to shard; -2 is latitude (H) in (B, C, H, W).
    :param comm: Parent mpi4py communicator; it is duplicated, never used directly.
    :param torch_bridge: Make ``domain_group``/``data_parallel_group`` torch.distributed
        groups with the communicators' membership and rank order, initialising
        torch.distributed from MPI (:func:`mpidomain.init_torch_distributed`) when
        needed; ``domain_comm``/``data_parallel_comm`` stay MPI.
    :param bind_device: GPU per rank when torch or cupy (already imported) sees CUDA:
        ``"auto"`` (node-local rank modulo the device count), a list (one device index per
        node-local rank) or ``"none"`` (leave it). See :func:`mpidomain.bind_device`.
    """

    def __init__(self, world_size, domain_parallel_size, shard_dim=-2, *, comm=None, torch_bridge=False,
                 bind_device="auto"):
        MPI = mpi()
        check_launcher_world(MPI.COMM_WORLD.Get_size(), library=MPI.Get_library_version().splitlines()[0])
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got {type(comm).__name__}"
            )
        raise_on_all_ranks(comm, _argument_error(world_size, domain_parallel_size, shard_dim, comm.Get_size())
                           or binding._policy_error(bind_device))
        check_same(comm, (world_size, domain_parallel_size, shard_dim, bool(torch_bridge), _plain(bind_device)),
                   "(world_size, domain_parallel_size, shard_dim, torch_bridge, bind_device)",
                   "Pass the same values everywhere.")
        self.torch_bridge = bool(torch_bridge)
        self._torch_default_group = bridge.acquire_default_group(comm) if self.torch_bridge else None

        self.world_size = int(world_size)
        self.domain_parallel_size = int(domain_parallel_size)
        self.data_parallel_size = self.world_size // self.domain_parallel_size
        self.shard_dim = int(shard_dim)
        self.launcher = detect_launcher()

        self._parent = comm
        self._comm = comm.Dup()
        rank = self._comm.Get_rank()
        d = self.domain_parallel_size
        self._rank = rank
        self._domain_group_idx = rank // d
        self._domain_rank = rank % d
        self._dp_rank = rank // d

        self._domain_comm = self._comm.Split(self._domain_group_idx, rank)
        self._dp_comm = self._comm.Split(self._domain_rank, rank)
        self._node_comm = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        self._domain_comm.Set_name(f"mpidomain.domain[{self._domain_group_idx}]")
        self._dp_comm.Set_name(f"mpidomain.data_parallel[{self._domain_rank}]")
        # The library's own traffic (halos, shard/gather, agreement steps) travels on duplicates
        # the user never holds, so no user receive (ANY_TAG included) can match it.
        self._private = {"domain": self._domain_comm.Dup(), "data": self._dp_comm.Dup()}
        self._next_tag = 16  # tags handed out collectively by allocate_tags()
        node_roots = self._comm.allgather(self._node_comm.allreduce(rank, op=MPI.MIN))
        distinct_roots = sorted(set(node_roots))
        self._node_index = distinct_roots.index(node_roots[rank])
        self._num_nodes = len(distinct_roots)
        # Before any torch groups: NCCL communicators use the current device.
        self.device_binding = None
        if bind_device != "none":
            self.device_binding = binding._bind(bind_device, self._comm, self.local_rank, self.local_size,
                                                self._node_index, binding._find_devices(import_libraries=False))

        self._domain_group = self._domain_comm
        self._dp_group = self._dp_comm
        self._torch_groups = ()
        if self.torch_bridge:
            self._torch_groups = bridge.new_torch_groups(
                [self.domain_group_ranks(i) for i in range(self.data_parallel_size)],
                [self.data_parallel_group_ranks(i) for i in range(self.domain_parallel_size)],
            )
            self._domain_group, self._dp_group = self._torch_groups
        self._closed = False
        self._close_callbacks = []
        logger.info(
            "domain parallel: rank %d, domain group %d (domain rank %d of %d), data-parallel rank %d of %d",
            rank, self._domain_group_idx, self._domain_rank, d, self._dp_rank, self.data_parallel_size,
        )

    # -- CREDIT's API -----------------------------------------------------
    @property
    def domain_group(self):
        """Group for domain-parallel communication: a torch ProcessGroup if bridged, else the communicator."""
        return self._domain_group

    @property
    def data_parallel_group(self):
        """Group for gradient sync: a torch ProcessGroup if bridged, else the communicator."""
        return self._dp_group

    @property
    def domain_rank(self):
        """Rank within the domain-parallel group (0 to domain_parallel_size-1)."""
        return self._domain_rank

    @property
    def domain_world_size(self):
        """Number of ranks in the domain-parallel group."""
        return self.domain_parallel_size

    @property
    def dp_rank(self):
        """Rank within the data-parallel group."""
        return self._dp_rank

    @property
    def dp_world_size(self):
        """Number of ranks in the data-parallel group."""
        return self.data_parallel_size

    @property
    def is_first_domain_rank(self):
        """True if this is the first rank in its domain group (north edge)."""
        return self._domain_rank == 0

    @property
    def is_last_domain_rank(self):
        """True if this is the last rank in its domain group (south edge)."""
        return self._domain_rank == self.domain_parallel_size - 1

    def neighbor_ranks(self):
        """Return ``(prev_rank, next_rank)`` as ranks of the parent communicator.

        ``None`` stands for a missing neighbour at the edges of the domain group.
        """
        prev_rank = self._rank - 1 if not self.is_first_domain_rank else None
        next_rank = self._rank + 1 if not self.is_last_domain_rank else None
        return prev_rank, next_rank

    # -- MPI specifics --------------------------------------------------------
    @property
    def comm(self):
        """The parent communicator the manager was built from."""
        return self._parent

    @property
    def domain_comm(self):
        """The mpi4py communicator of this rank's domain group (always MPI)."""
        return self._domain_comm

    @property
    def data_parallel_comm(self):
        """The mpi4py communicator of this rank's data-parallel group (always MPI)."""
        return self._dp_comm

    @property
    def rank(self):
        """Rank in the parent communicator."""
        return self._rank

    @property
    def local_rank(self):
        """Rank among the processes on this node (shared-memory domain)."""
        return self._node_comm.Get_rank()

    @property
    def local_size(self):
        """Number of processes on this node."""
        return self._node_comm.Get_size()

    @property
    def node_index(self):
        """Index of this node, 0 to ``num_nodes - 1``, in order of the lowest rank on it."""
        return self._node_index

    @property
    def num_nodes(self):
        """Number of nodes the job spans."""
        return self._num_nodes

    @property
    def closed(self):
        """True once :meth:`close` has freed the communicators."""
        return self._closed

    def domain_group_ranks(self, index=None):
        """Return the parent-communicator ranks of domain group ``index`` (default: ours)."""
        index = self._domain_group_idx if index is None else index
        d = self.domain_parallel_size
        return list(range(index * d, (index + 1) * d))

    def data_parallel_group_ranks(self, index=None):
        """Return the parent-communicator ranks of data-parallel group ``index`` (default: ours)."""
        index = self._domain_rank if index is None else index
        return list(range(index, self.world_size, self.domain_parallel_size))

    def close(self):
        """Free the communicators and destroy the torch groups this manager created.

        Collective over the parent communicator; idempotent. The default torch
        process group is destroyed only if a bridged manager created it and no
        other bridged manager still uses it.
        """
        global _MANAGER
        if self._closed:
            return
        self._closed = True
        if _MANAGER is self:
            _MANAGER = None
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback(self)
        if self._torch_groups:
            bridge.destroy_torch_groups(self._torch_groups)
            self._torch_groups = ()
        if self._torch_default_group is not None:
            bridge.release_default_group(self._torch_default_group)
            self._torch_default_group = None
        if is_active():
            for private in self._private.values():
                forget_timeout(private)
                private.Free()
            for name in ("_domain_comm", "_dp_comm", "_node_comm", "_comm"):
                forget_timeout(getattr(self, name))
                getattr(self, name).Free()
        self._domain_group = None
        self._dp_group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True) and is_active():
            warnings.warn(f"unclosed {self!r}: call close() (collective) or use a with block",
                          ResourceWarning, stacklevel=2)

    def __repr__(self):
        state = "closed" if self._closed else f"rank={self._rank}"
        return (
            f"DomainParallelManager(world_size={self.world_size}, "
            f"domain_parallel_size={self.domain_parallel_size}, shard_dim={self.shard_dim}, {state})"
        )


def library_comm(manager, group="domain"):
    """Return the library's private communicator of ``manager``: ``"domain"``, ``"data"`` or ``"world"``.

    ``"world"`` is the private duplicate of the parent communicator the
    groups were split from. The library's own messages travel only on these;
    users hold ``comm``, ``domain_comm`` and ``data_parallel_comm`` and never see them.
    """
    if manager.closed:
        raise RuntimeError(f"{manager!r} is closed; initialise a new manager")
    if group == "world":
        return manager._comm
    return manager._private[group]


def on_close(manager, callback):
    """Call ``callback(manager)`` when ``manager`` closes, before its communicators are freed.

    For modules that keep MPI resources per manager (halo plans) without the
    manager importing them. Local.
    """
    if manager.closed:
        raise RuntimeError(f"{manager!r} is closed; initialise a new manager")
    manager._close_callbacks.append(callback)


def allocate_tags(manager, count):
    """Return the first of ``count`` consecutive tags no other live plan of ``manager`` uses.

    Collective in effect: every rank of the group must call it in the same
    order (plan construction, itself agreed, is the only caller), so each
    rank gets the same tags. Tags cycle below MPI's guaranteed bound of 32767.
    """
    first = manager._next_tag
    if first + count > 32767:
        first = 16
    manager._next_tag = first + count
    return first


def _plain(policy):
    """A device policy as comparable across ranks (tuples and lists alike)."""
    return list(policy) if isinstance(policy, tuple) else policy


def initialize_domain_parallel(world_size, domain_parallel_size, shard_dim=-2, *, abort_on_error=None, **options):
    """Initialise the global :class:`DomainParallelManager` singleton and return it.

    Collective over ``options.get("comm", MPI.COMM_WORLD)``: call on all ranks
    with the same arguments. Replaces (and frees) a previous manager. Unless
    ``abort_on_error=False`` or ``MPIDOMAIN_ABORT_ON_ERROR=0``, installs a
    ``sys.excepthook`` that aborts every rank when one dies of an uncaught
    exception, so no rank waits forever.

    :param world_size: Number of ranks in the communicator.
    :param domain_parallel_size: Ranks per domain group.
    :param shard_dim: Spatial dimension to shard (-2 for latitude in BCHW).
    :param options: ``comm``, ``torch_bridge``, ``bind_device``: passed to the manager.
    """
    global _MANAGER
    manager = DomainParallelManager(world_size, domain_parallel_size, shard_dim, **options)
    previous, _MANAGER = _MANAGER, manager
    if previous is not None:
        previous.close()
    if abort.abort_on_error_enabled(abort_on_error):
        abort.install_abort_on_error()
    return manager


def get_domain_parallel_manager():
    """Return the global :class:`DomainParallelManager`, or None before initialisation."""
    return _MANAGER

"""Domain-parallel manager: the (data_parallel, tensor_parallel, domain_parallel) mesh over MPI.

Same API as NCAR CREDIT's ``credit.domain_parallel.manager``, but the groups
are MPI communicators built with ``Split`` on a duplicate of the parent
communicator, so it runs under any launcher (srun, mpiexec, mpirun, PALS) or
none. The layout is :class:`mpidomain.layout.mesh.Mesh`'s (CREDIT's ``credit.parallel``
DeviceMesh): row-major over (dp, tp, domain), domain innermost. With 8 ranks and
``domain_parallel_size=2``::

    domain groups:        [0,1] [2,3] [4,5] [6,7]
    data-parallel groups: [0,2,4,6] [1,3,5,7]

and with ``tensor_parallel_size=2`` as well::

    domain groups:          [0,1] [2,3] [4,5] [6,7]
    tensor-parallel groups: [0,2] [1,3] [4,6] [5,7]
    data-parallel groups:   [0,4] [1,5] [2,6] [3,7]
"""

import logging
import math
import warnings
from typing import NamedTuple

from . import abort, binding
from . import torch_bridge as bridge
from ._current import closed_error, current_manager, forget, make_current
from ._exit import stands_down_at_exit
from ._agreement import agree, must_match
from ._errors import rank_ranges
from ._mpi import is_active, mpi
from ._routing import share_agreements, unshare_agreements
from ._waits import forget_timeout
from ._validate import is_int
from .launcher import check_launcher_world, detect_launcher
from .layout.mesh import AXES, Mesh

__all__ = ["DomainParallelManager", "initialize_domain_parallel", "get_domain_parallel_manager"]

logger = logging.getLogger(__name__)

def domain_layout(domain_parallel_size, shard_dim):
    """Return ``(domain_shape, shard_dims)``: ``((D,), (dim,))`` for ints, the pairs for a 2-D decomposition.

    Raise TypeError/ValueError for anything else. Local, pure.
    """
    two_d = isinstance(domain_parallel_size, (tuple, list)) or isinstance(shard_dim, (tuple, list))
    if not two_d:
        for name, value in (("domain_parallel_size", domain_parallel_size), ("shard_dim", shard_dim)):
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}); or pairs for a 2-D "
                                "decomposition: domain_parallel_size=(D_lat, D_lon), shard_dim=(-2, -1)")
        return (int(domain_parallel_size),), (int(shard_dim),)
    shape, dims = domain_parallel_size, shard_dim
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2 and all(is_int(d) for d in shape)):
        raise TypeError(f"domain_parallel_size must be an int, or a pair (D_lat, D_lon) of ints with shard_dim=(-2, -1), "
                        f"got {shape!r} with shard_dim={dims!r}")
    if not (isinstance(dims, (tuple, list)) and len(dims) == 2 and all(is_int(d) for d in dims)):
        raise TypeError(f"shard_dim must be a pair of dims, e.g. (-2, -1), with domain_parallel_size={tuple(shape)!r}, "
                        f"got {dims!r}")
    if min(shape) < 1:
        raise ValueError(f"domain_parallel_size must be >= 1 along each dim, got {tuple(shape)!r}")
    if not all(d < 0 for d in dims) or dims[0] >= dims[1]:
        raise ValueError(f"shard_dim must be two negative dims in increasing order (latitude, then longitude), "
                         f"e.g. (-2, -1), got {tuple(dims)!r}")
    return (int(shape[0]), int(shape[1])), (int(dims[0]), int(dims[1]))


def _argument_error(world_size, domain_parallel_size, shard_dim, comm_size, tensor_parallel_size=1):
    """Return the first local problem with the arguments, or None."""
    try:
        shape, _ = domain_layout(domain_parallel_size, shard_dim)
    except (TypeError, ValueError) as exc:
        return exc
    label = domain_parallel_size
    if len(shape) == 2:
        domain_parallel_size = shape[0] * shape[1]
        label = f"{tuple(shape)}"
    for name, value in (("world_size", world_size), ("tensor_parallel_size", tensor_parallel_size)):
        if not is_int(value):
            return TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if world_size != comm_size:
        return ValueError(
            f"world_size={world_size} but the communicator has {comm_size} ranks; pass "
            f"world_size={comm_size} (the launcher's process count, e.g. mpiexec -n {comm_size})"
        )
    for name, value in (("domain_parallel_size", domain_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value < 1:
            return ValueError(f"{name} must be >= 1, got {value}")
    per_replica = tensor_parallel_size * domain_parallel_size
    if world_size % per_replica:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        if tensor_parallel_size == 1:
            return ValueError(
                f"domain_parallel_size={label}{'' if label == domain_parallel_size else f' ({domain_parallel_size} ranks)'} "
                f"does not divide world_size={world_size}; "
                f"choose one of {divisors} or launch a multiple of {domain_parallel_size} ranks"
            )
        return ValueError(
            f"tensor_parallel_size={tensor_parallel_size} x domain_parallel_size={label} = "
            f"{per_replica} does not divide world_size={world_size}; choose sizes whose product is one of "
            f"{divisors}, or launch a multiple of {per_replica} ranks"
        )
    return None


@stands_down_at_exit
class DomainParallelManager:
    """Build and hold the domain-parallel and data-parallel communicators.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): every rank must call
    it with the same arguments. A mistake seen on any rank raises the same
    ValueError or TypeError on every rank.

    :param world_size: Number of ranks in ``comm``.
    :param domain_parallel_size: Ranks per domain-parallel group (D), or ``(D_lat, D_lon)`` for
        tiles: a group of ``D_lat * D_lon`` ranks (``domain_parallel_size`` is then that product,
        ``domain_shape`` the pair, ``domain_coords`` this rank's ``(i_lat, i_lon)``).
    :param shard_dim: Spatial dimension to shard; -2 is latitude (H) in (B, C, H, W). With a
        pair of sizes, the pair of dims (latitude, longitude), e.g. ``(-2, -1)``.
    :param tensor_parallel_size: Ranks per tensor-parallel group (T); ``T * D`` must divide
        ``world_size``, and ``data_parallel_size`` is ``world_size // (T * D)``. With 1 (the
        default) the layout is the two-axis one of CREDIT's manager.
    :param comm: Parent mpi4py communicator; it is duplicated, never used directly.
    :param torch_bridge: Make ``domain_group``, ``tensor_parallel_group`` and
        ``data_parallel_group`` torch.distributed groups with the communicators' membership
        and rank order, initialising torch.distributed from MPI
        (:func:`mpidomain.init_torch_distributed`) when needed, and offer them as
        :attr:`device_mesh`; ``domain_comm``, ``tensor_parallel_comm`` and
        ``data_parallel_comm`` stay MPI.
    :param bind_device: GPU per rank when torch or cupy (already imported) sees CUDA:
        ``"auto"`` (node-local rank modulo the device count), a list (one device index per
        node-local rank) or ``"none"`` (leave it). See :func:`mpidomain.bind_device`.
    :param abort_on_error: Install the ``sys.excepthook`` that aborts every rank when one dies
        of an uncaught exception (:func:`mpidomain.abort.install_abort_on_error`), as
        :func:`initialize_domain_parallel` does; default: unless ``MPIDOMAIN_ABORT_ON_ERROR=0``.

    ``number`` is the manager's number, alike on every rank (1 for the first manager): errors
    name managers by it.
    """

    def __init__(self, world_size, domain_parallel_size, shard_dim=-2, *, tensor_parallel_size=1, comm=None,
                 torch_bridge=False, bind_device="auto", abort_on_error=None):
        MPI = mpi()
        check_launcher_world(MPI.COMM_WORLD.Get_size(), library=MPI.Get_library_version().splitlines()[0])
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm):
            raise TypeError(
                f"comm must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got {type(comm).__name__}"
            )
        error = (_argument_error(world_size, domain_parallel_size, shard_dim, comm.Get_size(), tensor_parallel_size)
                 or binding._policy_error(bind_device))
        # A rank with a local error describes nothing: its arguments may not even pickle.
        description = None if error is not None else tuple(
            _plain(v) for v in (world_size, domain_parallel_size, shard_dim, tensor_parallel_size, bool(torch_bridge),
                                bind_device))
        agree(comm, "DomainParallelManager", description, error=error, mismatch=must_match(
            "(world_size, domain_parallel_size, shard_dim, tensor_parallel_size, torch_bridge, bind_device)",
            "Pass the same values everywhere."))
        self.torch_bridge = bool(torch_bridge)
        self._torch_default_group = bridge.acquire_default_group(comm) if self.torch_bridge else None

        self.world_size = int(world_size)
        self.domain_shape, self.shard_dims = domain_layout(domain_parallel_size, shard_dim)
        self.domain_parallel_size = math.prod(self.domain_shape)  # the group's size, as CREDIT's
        self.tensor_parallel_size = int(tensor_parallel_size)
        self.data_parallel_size = self.world_size // (self.tensor_parallel_size * self.domain_parallel_size)
        self.shard_dim = self.shard_dims[0] if len(self.shard_dims) == 1 else self.shard_dims
        self.launcher = detect_launcher()

        self._parent = comm
        self._comm = comm.Dup()
        rank = self._rank = self._comm.Get_rank()
        self.mesh = Mesh((self.data_parallel_size, self.tensor_parallel_size, self.domain_parallel_size), rank)
        self._domain_group_idx = self.mesh.group_index("domain")
        self._dp_rank, self._tp_rank, self._domain_rank = self.mesh.coords

        # One Split per axis, coloured by the index of this rank's group along it
        # (scripts/bench/bench_manager.py measures it against Create_cart and Sub).
        self._domain_comm, self._tp_comm, self._dp_comm = (
            self._comm.Split(self.mesh.group_index(axis), rank) for axis in ("domain", "tp", "dp"))
        self._domain_comm.Set_name(f"mpidomain.domain[{self._domain_group_idx}]")
        self._tp_comm.Set_name(f"mpidomain.tensor_parallel[{self.mesh.group_index('tp')}]")
        self._dp_comm.Set_name(f"mpidomain.data_parallel[{self.mesh.group_index('dp')}]")
        # The library's own traffic (halos, shard/gather, agreement steps) travels on duplicates
        # the user never holds, so no user receive (ANY_TAG included) can match it.
        self._private = {"domain": self._domain_comm.Dup(), "tp": self._tp_comm.Dup(), "data": self._dp_comm.Dup()}
        if self.tiled:  # a band of one latitude row, a column of one longitude
            i_lat, i_lon = self.domain_coords
            self._private["band"] = self._private["domain"].Split(i_lat, i_lon)
            self._private["column"] = self._private["domain"].Split(i_lon, i_lat)
        # Names for the library's messages (a timeout names the group it waited in).
        self._comm.Set_name(f"the manager's communicator ({comm.Get_size()} ranks)")
        for key, axis, label in (("domain", "domain", "domain"), ("tp", "tp", "tensor-parallel"),
                                 ("data", "dp", "data-parallel")):
            self._private[key].Set_name(f"{label} group {self.mesh.group_index(axis)} "
                                        f"(ranks {rank_ranges(list(self.mesh.group_ranks(axis)))})")
        if self.tiled:
            domain = self._private["domain"].Get_name()
            self._private["band"].Set_name(f"tile row {i_lat} of {domain}")
            self._private["column"].Set_name(f"tile column {i_lon} of {domain}")
        # Agreements of managers with the same groups meet on shared communicators, so ranks using two
        # managers in different orders raise at once, naming both (by a number the ranks agree on).
        self._library_comms = [*self._private.values(), self._comm]
        self.number = share_agreements(self._comm, self._library_comms, "manager #{number} " + self._describe())
        self._next_tag = 16  # tags handed out collectively by allocate_tags()
        self._node_comm, self._node_index, self._num_nodes = binding.node_of(self._comm)
        # Before any torch groups: NCCL communicators use the current device.
        self.device_binding = None
        if bind_device != "none":
            self.device_binding = binding._bind(bind_device, self._comm, self.local_rank, self.local_size,
                                                self._node_index, binding._find_devices(import_libraries=False))

        self._domain_group, self._tp_group, self._dp_group = self._domain_comm, self._tp_comm, self._dp_comm
        self._torch_groups = ()
        self._device_mesh = None
        if self.torch_bridge:
            self._torch_groups = bridge.new_torch_groups([self.mesh.groups(axis) for axis in ("domain", "tp", "dp")])
            self._domain_group, self._tp_group, self._dp_group = self._torch_groups
        self._closed = False
        self._close_callbacks = []
        if abort.abort_on_error_enabled(abort_on_error):
            abort.install_abort_on_error()
        logger.info(
            "domain parallel: rank %d, domain group %d (domain rank %d of %d), tensor-parallel rank %d of %d, "
            "data-parallel rank %d of %d", rank, self._domain_group_idx, self._domain_rank, self.domain_parallel_size,
            self._tp_rank, self.tensor_parallel_size, self._dp_rank, self.data_parallel_size,
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

        Along latitude (the first of ``shard_dims``): with a 2-D decomposition,
        the ranks of the same longitude column in the tile rows above and below.
        ``None`` stands for a missing neighbour at the edges of the domain group.
        """
        step = self.domain_shape[-1] if self.tiled else 1
        return self.mesh.neighbor("domain", -step), self.mesh.neighbor("domain", step)

    # -- 2-D decomposition -------------------------------------------------
    @property
    def tiled(self):
        """True for tiles (``domain_shape`` is ``(D_lat, D_lon)``: a 2-D decomposition), False for slabs.

        The one test of tiles or slabs: every module asks it here. Read-only.
        """
        return len(self.domain_shape) == 2

    @property
    def domain_coords(self):
        """This rank's place in its domain group: ``(i_lat, i_lon)`` in 2-D, ``(domain_rank,)`` in 1-D.

        Domain ranks are row-major over (lat, lon): ``domain_rank = i_lat * D_lon + i_lon``.
        """
        return self.domain_coords_of(self._domain_rank)

    def domain_coords_of(self, domain_rank):
        """Return the tile coordinates of ``domain_rank`` (see :attr:`domain_coords`). Local."""
        if not self.tiled:
            return (int(domain_rank),)
        return divmod(int(domain_rank), self.domain_shape[1])

    # -- The tensor-parallel axis (CREDIT's credit.parallel) -------------------
    @property
    def tensor_parallel_group(self):
        """Group for tensor parallelism: a torch ProcessGroup if bridged, else the communicator."""
        return self._tp_group

    @property
    def tp_rank(self):
        """Rank within the tensor-parallel group (0 to tensor_parallel_size-1)."""
        return self._tp_rank

    @property
    def tp_world_size(self):
        """Number of ranks in the tensor-parallel group."""
        return self.tensor_parallel_size

    def data_parallel_coords(self):
        """Return ``(dp_rank, dp_size)``: the ``rank=`` and ``num_replicas=`` of a DistributedSampler.

        Ranks that differ only in their tensor-parallel or domain coordinate get
        the same pair, so they read the same batch. Local.
        """
        return self._dp_rank, self.data_parallel_size

    @property
    def device_mesh(self):
        """The torch ``DeviceMesh`` of shape (dp, tp, domain), dims named ``("dp", "tp", "domain")``.

        Needs ``torch_bridge=True``. Its per-axis process groups are the bridged
        groups themselves, so ``device_mesh["dp"]``, ``["tp"]`` and ``["domain"]``
        have exactly the members of ``data_parallel_comm``, ``tensor_parallel_comm``
        and ``domain_comm``; pass them to ``fully_shard(..., mesh=...)`` and
        ``parallelize_module(..., device_mesh=...)``. Size-1 axes stay, each rank
        its own group, as in ``init_device_mesh``. Built on first use, locally
        (no communication); :meth:`close` releases it with the groups.
        """
        if self._closed:
            raise closed_error(self)
        if not self.torch_bridge:
            raise RuntimeError(
                "device_mesh needs torch.distributed groups: build the manager with torch_bridge=True"
            )
        if self._device_mesh is None:
            domain, tp, dp = self._torch_groups
            self._device_mesh = bridge.device_mesh([dp, tp, domain], self.mesh.layout(), AXES)
        return self._device_mesh

    def library_comm(self, group="domain"):
        """Return the library's private communicator: ``"domain"``, ``"tp"``, ``"data"`` or ``"world"``.

        With tiles also ``"band"`` (the tiles of this rank's latitude row, by ``i_lon``) and
        ``"column"`` (those of its longitude column, by ``i_lat``).

        ``"world"`` is the private duplicate of the parent communicator the
        groups were split from. The library's own messages travel only on these;
        users hold ``comm``, ``domain_comm`` and ``data_parallel_comm`` and never see them. Local.
        """
        if self._closed:
            raise closed_error(self)
        if group == "world":
            return self._comm
        return self._private[group]

    def on_close(self, callback):
        """Call ``callback(self)`` when the manager closes, before its communicators are freed.

        For modules that keep MPI resources per manager (halo plans) without the
        manager importing them. Local.
        """
        if self._closed:
            raise closed_error(self)
        self._close_callbacks.append(callback)

    def allocate_tags(self, count):
        """Return the first of ``count`` consecutive tags no other live plan of this manager uses.

        Collective in effect: every rank of the group must call it in the same
        order (plan construction, itself agreed, is the only caller), so each
        rank gets the same tags. Tags cycle below MPI's guaranteed bound of 32767.
        """
        first = self._next_tag
        if first + count > 32767:
            first = 16
        self._next_tag = first + count
        return first

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
    def tensor_parallel_comm(self):
        """The mpi4py communicator of this rank's tensor-parallel group (always MPI)."""
        return self._tp_comm

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
        return self.mesh.group_ranks("domain", index)

    def tensor_parallel_group_ranks(self, index=None):
        """Return the parent-communicator ranks of tensor-parallel group ``index`` (default: ours)."""
        return self.mesh.group_ranks("tp", index)

    def data_parallel_group_ranks(self, index=None):
        """Return the parent-communicator ranks of data-parallel group ``index`` (default: ours).

        With ``tensor_parallel_size=1``, group ``j`` holds the ranks of domain rank ``j``.
        """
        return self.mesh.group_ranks("dp", index)

    def close(self):
        """Free the communicators and destroy the torch groups this manager created.

        Collective over the parent communicator; idempotent. The default torch
        process group is destroyed only if a bridged manager created it and no
        other bridged manager still uses it.
        """
        if self._closed:
            return
        self._closed = True
        forget(self)
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback(self)
        self._device_mesh = None
        if self._torch_groups:
            bridge.destroy_torch_groups(self._torch_groups)
            self._torch_groups = ()
        if self._torch_default_group is not None:
            bridge.release_default_group(self._torch_default_group)
            self._torch_default_group = None
        if is_active():
            unshare_agreements(self._library_comms)
            for private in self._private.values():
                forget_timeout(private)
                private.Free()
            for name in ("_domain_comm", "_tp_comm", "_dp_comm", "_node_comm", "_comm"):
                forget_timeout(getattr(self, name))
                getattr(self, name).Free()
        self._domain_group = self._tp_group = self._dp_group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        # At interpreter exit an open manager is no leak: MPI_Finalize frees its communicators.
        if not self._exiting and not getattr(self, "_closed", True) and is_active():
            warnings.warn(f"unclosed {self!r}: call close() (collective) or use a with block",
                          ResourceWarning, stacklevel=2)

    def __repr__(self):
        state = "closed" if self._closed else f"rank={self._rank}"
        return f"{self._describe()[:-1]}, {state})"

    def _describe(self):
        """The constructor call, alike on every rank."""
        return (
            f"DomainParallelManager(world_size={self.world_size}, "
            f"domain_parallel_size={self.domain_shape if self.tiled else self.domain_parallel_size}, "
            f"shard_dim={self.shard_dim}"
            f"{f', tensor_parallel_size={self.tensor_parallel_size}' if self.tensor_parallel_size > 1 else ''})"
        )


def library_comm(manager, group="domain"):
    """Return ``manager.library_comm(group)``: the library's private communicator (see the method)."""
    return manager.library_comm(group)


class ShardedDim(NamedTuple):
    """One dim of an array that a manager shards (see :func:`sharded_dims`)."""

    dim: int        # the dim of the array, normalised (0 to ndim - 1)
    shard_dim: int  # the manager's own spelling of it, e.g. -2
    axis: int       # its place among the manager's sharded dims: 0 latitude, 1 longitude (tiles)
    parts: int      # the number of tiles (slabs) along it
    coord: int      # this rank's tile coordinate along it
    group: str      # the library_comm group of the ranks that share it: "domain" for slabs, "column"/"band" for tiles


def sharded_dims(manager, ndim):
    """Return the dims of an ``ndim``-d array that ``manager`` shards, as :class:`ShardedDim`, in the manager's order.

    The one answer to "which dims of x does the manager shard": the manager's
    ``shard_dims`` that an ``ndim``-d array has (a dim it lacks is left out; the
    caller decides whether that is a mistake), each with its number of parts,
    this rank's coordinate and the group of ranks along it (tiles: latitude moves
    within a column of tiles, longitude within a band). Local.
    """
    groups = ("column", "band") if manager.tiled else ("domain",)
    coords = manager.domain_coords
    return tuple(ShardedDim(d % ndim, d, k, parts, coords[k], groups[k])
                 for k, (d, parts) in enumerate(zip(manager.shard_dims, manager.domain_shape)) if -ndim <= d < ndim)


def _plain(value):
    """``value`` as comparable across ranks by its repr (what an agreement compares): tuples and lists alike
    (as lists), NumPy ints as ints. Local."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return int(value) if is_int(value) else value


def initialize_domain_parallel(world_size, domain_parallel_size, shard_dim=-2, *, tensor_parallel_size=1,
                               abort_on_error=None, **options):
    """Initialise the global :class:`DomainParallelManager` singleton and return it.

    Collective over ``options.get("comm", MPI.COMM_WORLD)``: call on all ranks
    with the same arguments. Replaces (and frees) a previous manager. Unless
    ``abort_on_error=False`` or ``MPIDOMAIN_ABORT_ON_ERROR=0``, installs a
    ``sys.excepthook`` that aborts every rank when one dies of an uncaught
    exception, so no rank waits forever (as :class:`DomainParallelManager` does).

    :param world_size: Number of ranks in the communicator.
    :param domain_parallel_size: Ranks per domain group, or ``(D_lat, D_lon)`` for 2-D tiles.
    :param shard_dim: Spatial dimension to shard (-2 for latitude in BCHW), or ``(-2, -1)`` for tiles.
    :param tensor_parallel_size: Ranks per tensor-parallel group (see :class:`DomainParallelManager`).
    :param options: ``comm``, ``torch_bridge``, ``bind_device``: passed to the manager.
    """
    manager = DomainParallelManager(world_size, domain_parallel_size, shard_dim,
                                    tensor_parallel_size=tensor_parallel_size, abort_on_error=abort_on_error, **options)
    previous = make_current(manager)
    if previous is not None:
        previous.close()
    return manager


def get_domain_parallel_manager():
    """Return the global :class:`DomainParallelManager`, or None before initialisation."""
    return current_manager()


def __getattr__(name):
    """Read ``_MANAGER``, the seed's module data (CREDIT's ``manager._MANAGER``), as the current manager.

    The current manager lives in :mod:`mpidomain._current`; reading
    ``mpidomain.manager._MANAGER`` gives what :func:`get_domain_parallel_manager`
    returns, at any time. Local.
    """
    if name == "_MANAGER":
        return current_manager()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Start torch.distributed from MPI, and mirror the manager's communicators as torch groups.

No torchrun and no hand-set MASTER_ADDR: rank and size come from MPI, rank 0
chooses the rendezvous address and port and broadcasts them over MPI, so the
same program starts under srun, mpiexec, mpirun, PALS or plain python.
Importing this module imports neither MPI nor torch.
"""

import datetime
import inspect
import ipaddress
import os
import socket
import sys

from ._agreement import agree, must_match
from ._errors import error_report, raise_reported
from ._mpi import mpi
from .binding import node_of

__all__ = [
    "init_torch_distributed",
    "master_address",
    "master_port",
    "acquire_default_group",
    "release_default_group",
    "new_torch_groups",
    "device_mesh",
    "destroy_torch_groups",
]

# The default process group when a bridged manager created it, and how many live managers use it.
_managed_default_group = None
_managed_default_users = 0


def master_address(environ=None):
    """Return the rendezvous host: ``MASTER_ADDR`` if set, else a non-loopback address of this host, else its name.

    The address comes from resolving the host's names, then from the source
    address of its default routes, then from its network interfaces
    (link-local addresses are skipped).
    """
    env = os.environ if environ is None else environ
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    return _non_loopback_address() or socket.gethostname()


def master_port(environ=None):
    """Return the rendezvous port: ``MASTER_PORT`` if set, else a free port found by binding port 0.

    A port found free can be taken by another process before the rendezvous
    binds it; where that happens, set ``MASTER_PORT``.
    """
    env = os.environ if environ is None else environ
    value = env.get("MASTER_PORT")
    if value:
        try:
            port = int(value)
        except ValueError:
            port = -1
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT must be a port number from 1 to 65535, got {value!r}; "
                             "unset it to let rank 0 pick a free port, or set a free one")
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _host_addresses():
    """Yield this host's addresses: its names' resolutions, the source of its default routes, its interfaces'."""
    for name in dict.fromkeys((socket.gethostname(), socket.getfqdn())):
        try:
            for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM):
                yield info[4][0]
        except OSError:
            continue
    # Connecting a UDP socket sends nothing; it only asks the kernel which address a route would use.
    for family, target in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((target, 9))
                yield probe.getsockname()[0]
        except OSError:
            continue
    # A node whose name resolves nowhere and that has no default route (a cluster network with
    # no way out) still has addresses on its interfaces.
    yield from _interface_addresses()


def _interface_addresses():
    """Yield the IPv4 address of each network interface, in interface order (Linux; elsewhere nothing)."""
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError, AttributeError):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                request = struct.pack("256s", name.encode()[:15])
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this interface
                continue
            yield socket.inet_ntoa(reply[20:24])


def _non_loopback_address():
    """Return the first address of this host that other hosts can reach, or None."""
    for address in _host_addresses():
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            continue
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            return address
    return None


def _timedelta(timeout):
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise TypeError(f"timeout must be None, a datetime.timedelta or a positive number of seconds, got {timeout!r}")


def _local_layout(comm):
    """Return (local_rank, local_size) among the ranks of ``comm`` on this node; collective over ``comm``.

    The node is :func:`mpidomain.binding.node_of`'s, the one node rule: LOCAL_RANK here is the
    manager's ``local_rank``, the rank ``bind_device`` binds by.
    """
    node, _, _ = node_of(comm)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _bound_device(torch, local_rank):
    """Return the CUDA device of this process: the current one if CUDA is in use, else ``local_rank``'s."""
    if not torch.cuda.is_initialized():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _check_existing(states, size):
    """Raise, alike on every rank, unless torch.distributed is initialised everywhere with MPI's rank and size.

    ``states`` is every rank's ``(torch rank, torch world size)``, or False
    where torch.distributed is not initialised. Local: the states are gathered.
    """
    if not all(states):
        missing = [r for r, s in enumerate(states) if not s]
        raise RuntimeError(
            f"torch.distributed is initialised on some ranks but not on ranks {missing}; "
            "initialise it on every rank or on none (init_torch_distributed does it for you)"
        )
    reports = [None if state == (rank, size) else error_report(RuntimeError(
        f"torch.distributed is already initialised with rank {state[0]} of {state[1]}, but this process is "
        f"MPI rank {rank} of {size}; initialise torch.distributed with MPI's rank and size (or let "
        "init_torch_distributed do it), or pass the matching communicator as comm="))
        for rank, state in enumerate(states)]
    raise_reported(reports)


def init_torch_distributed(backend=None, *, comm=None, timeout=None):
    """Initialise torch.distributed's default process group from MPI.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): call on all ranks
    with the same arguments. Torch rank and world size are the rank and size
    in ``comm``. Rank 0 chooses MASTER_ADDR (the environment's, else a
    non-loopback address of its host, else its hostname) and MASTER_PORT (the
    environment's, else a free port) and broadcasts them; every rank
    rendezvouses there. RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT are set only where absent, so torchrun's are
    never clobbered. The backend is NCCL when CUDA is available, else gloo,
    unless ``backend`` names one; NCCL gets the bound device (the current one
    if CUDA is in use, else ``LOCAL_RANK % device_count``).

    If torch.distributed is already initialised, only checks that its rank
    and size agree with MPI's; a disagreement raises RuntimeError on every rank.

    :param backend: torch.distributed backend name, or None to choose.
    :param comm: mpi4py intracommunicator whose ranks become torch's.
    :param timeout: Collective timeout (timedelta or seconds); None for torch's default.
    :returns: True on every rank if this call created the default process group,
        False if it was already initialised.
    """
    MPI = mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"comm must be an mpi4py intracommunicator such as MPI.COMM_WORLD, got {type(comm).__name__}")
    error = None
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_available():
            error = RuntimeError("this torch build has no torch.distributed; install a build with it")
    except ImportError as missing:
        error = RuntimeError(f"init_torch_distributed needs PyTorch ({missing}); pip install 'mpidomain[torch]'")
    else:
        try:
            timeout = _timedelta(timeout)
        except TypeError as bad:
            error = bad
    state = None
    if error is None:
        state = dist.is_initialized() and (dist.get_rank(), dist.get_world_size())
    agree(comm, "init_torch_distributed", None, error=error)
    states = comm.allgather(state)  # who is initialised
    if any(states):
        _check_existing(states, comm.Get_size())
        return False

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    backend = str(backend)
    agree(comm, "init_torch_distributed", backend, mismatch=must_match(
        "backend", "Pass the same backend= on every rank (with backend=None, CUDA was available on some ranks only)."))
    rank, size = comm.Get_rank(), comm.Get_size()
    local_rank, local_size = _local_layout(comm)
    rendezvous, error = None, None
    if rank == 0:
        try:
            rendezvous = master_address(), master_port()
        except (OSError, ValueError) as failure:
            error = failure
    agree(comm, "init_torch_distributed", None, error=error)
    address, port = comm.bcast(rendezvous, root=0)

    for name, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                        ("LOCAL_WORLD_SIZE", local_size), ("MASTER_ADDR", address), ("MASTER_PORT", port)):
        if not os.environ.get(name):
            os.environ[name] = str(value)
    options = {}
    if timeout is not None:
        options["timeout"] = timeout
    takes_device = "device_id" in inspect.signature(dist.init_process_group).parameters  # torch >= 2.3
    if "nccl" in backend and torch.cuda.is_available() and takes_device:
        options["device_id"] = _bound_device(torch, local_rank)
    host = f"[{address}]" if ":" in address else address
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size, **options)
    return True


def acquire_default_group(comm):
    """Make sure torch.distributed is initialised over ``comm`` for a bridged manager.

    Collective over ``comm``. Returns the default group if bridged managers
    created it (the caller then shares it and must release it), None if the
    program initialised torch.distributed itself.
    """
    global _managed_default_group, _managed_default_users
    import torch.distributed as dist

    if init_torch_distributed(comm=comm):
        _managed_default_group, _managed_default_users = dist.group.WORLD, 0
    if dist.group.WORLD is not _managed_default_group:
        return None
    _managed_default_users += 1
    return _managed_default_group


def release_default_group(group):
    """Drop a share of ``group`` from :func:`acquire_default_group`; destroy it when the last share goes.

    Collective over the default group's ranks. A group the program destroyed
    and replaced meanwhile is left alone.
    """
    global _managed_default_group, _managed_default_users
    import torch.distributed as dist

    if group is not _managed_default_group:
        return
    _managed_default_users -= 1
    if _managed_default_users == 0:
        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
        _managed_default_group = None


def new_torch_groups(axes):
    """Create torch groups with exactly these memberships; return this rank's group along each axis.

    ``axes`` is a list, per axis, of every group's ascending global ranks.
    Collective over torch's default group: every rank passes the same lists,
    and the groups are created in that order everywhere (the order NCCL's
    communicator splits need).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = []
    for groups in axes:
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine.append(group)
    return tuple(mine)


def device_mesh(groups, layout, names):
    """Return a torch ``DeviceMesh`` whose dims are ``groups`` (this rank's group per dim), in order.

    ``layout`` is the nested list of global ranks (``layout[i][j]...``), ``names``
    the dim names. The device type is CUDA when the default group is NCCL, else
    CPU. Local: the groups exist already, nothing is communicated.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return DeviceMesh.from_group(list(groups), device_type, mesh=layout, mesh_dim_names=tuple(names))


def destroy_torch_groups(groups):
    """Destroy torch groups this rank belongs to, and forget DTensor plans made over them.

    Collective over their members. DTensor caches its sharding and
    redistribution plans by mesh equality, which ignores the groups, so a
    later mesh of the same shape over new groups would run a cached plan on
    the destroyed ones ("Could not resolve the process group"); the caches are
    cleared (they refill on the next DTensor operation).
    """
    import torch.distributed as dist

    for group in groups:
        if dist.is_initialized():
            dist.destroy_process_group(group)
    if "torch.distributed.tensor" in sys.modules:
        _clear_dtensor_caches()


def _clear_dtensor_caches():
    """Clear DTensor's sharding-propagation caches (Python and C++) and its redistribution planner's."""
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    debug._clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    # Newer torch also caches by mesh its redistribution planners and each mesh's topology, holding the mesh and
    # so its groups: a closed manager's gloo groups, with their threads, would live on.
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    topology = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if hasattr(topology, "cache_clear"):
        topology.cache_clear()

"""Bind each rank to a GPU, and warn when ranks share one without having asked to.

``auto`` gives node-local rank r the device ``r % device_count``: one GPU per rank when
the launcher leaves every rank all the node's GPUs, and still right when it already
gave each rank one (then ``device_count`` is 1). Which physical GPU a rank got is
compared across the node by UUID (or PCI bus id), so two ranks on one GPU show up
whatever ``CUDA_VISIBLE_DEVICES`` says.
"""

import importlib.util
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

from ._agreement import agree, must_match
from ._mpi import mpi

__all__ = ["DeviceBinding", "bind_device"]


@dataclass(frozen=True)
class DeviceBinding:
    """The GPU one rank uses: its index among the visible devices, and which GPU that is."""

    policy: object
    device: Optional[int] = None
    identity: str = ""
    library: str = ""
    shared_with: tuple = ()

    def describe(self):
        """Return a short description such as ``'cuda:1 (GPU-5e3a1b2c)'`` or ``'no CUDA device'``."""
        if self.device is None:
            return "no CUDA device"
        text = f"cuda:{self.device}"
        if self.identity:  # a UUID's first 8 hex digits tell a node's GPUs apart
            text += f" ({self.identity[:12] if self.identity.startswith('GPU-') else self.identity})"
        if self.shared_with:
            text += f", shared with rank{'s' * (len(self.shared_with) > 1)} {','.join(map(str, self.shared_with))}"
        return text


class _Devices:
    """The CUDA devices this process sees, through one library (torch or cupy)."""

    def __init__(self, library, count, current, select, identity):
        self.library = library
        self.count = count
        self.current = current
        self.select = select
        self.identity = identity


def _torch_devices():
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None

    def identity(index):
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            return f"GPU-{uuid}"
        if getattr(props, "pci_bus_id", None) is not None:
            return f"PCI {props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}"
        return ""

    return _Devices("torch", torch.cuda.device_count(), torch.cuda.current_device, torch.cuda.set_device, identity)


def _cupy_devices():
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if count == 0:
        return None

    def identity(index):
        uuid = cupy.cuda.runtime.getDeviceProperties(index).get("uuid")
        if uuid:
            return "GPU-" + bytes(uuid).hex()
        return f"PCI {cupy.cuda.Device(index).pci_bus_id}"

    return _Devices("cupy", count, lambda: cupy.cuda.Device().id, lambda i: cupy.cuda.Device(i).use(), identity)


def _find_devices(import_libraries):
    """Return the visible CUDA devices, or None; only through libraries already imported unless asked."""
    for name, find in (("torch", _torch_devices), ("cupy", _cupy_devices)):
        if name not in sys.modules and not (import_libraries and importlib.util.find_spec(name)):
            continue
        try:
            devices = find()
        except Exception:  # no driver, broken install: each library raises its own errors
            continue
        if devices is not None:
            return devices
    return None


def _policy_error(policy):
    if policy in ("auto", "none"):
        return None
    if isinstance(policy, (list, tuple)) and policy and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in policy
    ):
        return None
    return ValueError(
        f"bind_device must be 'auto', 'none' or a list of device indices, one per node-local rank "
        f"(e.g. [0, 1, 2, 3]), got {policy!r}"
    )


def _choose(policy, local_rank, local_size, devices):
    """Return (device index or None, error or None) for this rank under ``policy``."""
    host = socket.gethostname()
    if devices is None:
        return None, None
    if policy == "none":
        return devices.current(), None
    if policy == "auto":
        return local_rank % devices.count, None
    if len(policy) < local_size:
        return None, ValueError(
            f"bind_device={list(policy)} names a device for {len(policy)} node-local ranks, but {host} "
            f"runs {local_size}; list one device index per node-local rank"
        )
    index = policy[local_rank]
    if index >= devices.count:
        return None, ValueError(
            f"bind_device={list(policy)} gives node-local rank {local_rank} device {index}, but {host} "
            f"shows this rank {devices.count} CUDA device(s) (0-{devices.count - 1}); list existing devices "
            f"or check CUDA_VISIBLE_DEVICES"
        )
    return index, None


def _shared(reports, policy):
    """Group ranks on one physical GPU: {rank: (others...)} and the unasked groups.

    ``reports[rank]`` is (node index, local rank, device index or None, identity). Sharing
    is asked for when ``policy`` is a list giving those local ranks the same index.
    """
    groups = {}
    for rank, (node, local_rank, device, identity) in enumerate(reports):
        if device is not None:
            groups.setdefault((node, identity or f"cuda:{device}"), []).append(rank)
    shared, unasked = {}, []
    for ranks in groups.values():
        if len(ranks) < 2:
            continue
        for rank in ranks:
            shared[rank] = tuple(r for r in ranks if r != rank)
        asked = isinstance(policy, (list, tuple)) and len({policy[reports[r][1]] for r in ranks}) == 1
        if not asked:
            unasked.append(ranks)
    return shared, unasked


def _bind(policy, comm, local_rank, local_size, node_index, devices):
    """Collective core of :func:`bind_device`: choose, select, gather, warn."""
    error = _policy_error(policy)
    description = None if error is not None else list(policy) if isinstance(policy, tuple) else policy
    agree(comm, "bind_device", description, error=error,
          mismatch=must_match("bind_device", "pass the same policy on every rank"))
    index, error = _choose(policy, local_rank, local_size, devices)
    agree(comm, "bind_device", None, error=error)
    identity = ""
    if index is not None:
        if policy != "none":
            devices.select(index)
        identity = devices.identity(index)
    reports = comm.allgather((node_index, local_rank, index, identity))
    shared, unasked = _shared(reports, policy)
    if unasked and comm.Get_rank() == 0:
        listing = "; ".join(
            f"ranks {','.join(map(str, ranks))} on {reports[ranks[0]][3] or 'cuda:%d' % reports[ranks[0]][2]}"
            for ranks in unasked
        )
        warnings.warn(
            f"mpidomain.bind_device({policy!r}): ranks share a GPU: {listing}. More ranks per node than "
            "GPUs, or a launcher that gave them the same one; start one rank per GPU, or pass an explicit "
            "list to share on purpose",
            RuntimeWarning,
            stacklevel=3,
        )
    return DeviceBinding(
        policy=policy,
        device=index,
        identity=identity,
        library=devices.library if devices is not None else "",
        shared_with=shared.get(comm.Get_rank(), ()),
    )


def bind_device(policy="auto", manager=None, *, comm=None):
    """Make this rank's GPU the current CUDA device; return a :class:`DeviceBinding`.

    Collective over ``manager``'s communicator (else ``comm``, default ``MPI.COMM_WORLD``):
    call on all ranks with the same ``policy``. ``"auto"``: node-local rank r gets
    device ``r % device_count``; ``"none"``: leave the current device, only report it;
    a list: node-local rank r gets ``policy[r]``. Devices come from torch, else cupy
    (imported here if installed). Every rank gets its own binding; rank 0 warns
    (RuntimeWarning) naming the ranks that share a GPU they did not ask to share.
    Without CUDA every rank gets a binding with ``device=None``.
    """
    MPI = mpi()
    if manager is not None:
        return _bind(policy, manager.library_comm("world"), manager.local_rank, manager.local_size, manager.node_index,
                     _find_devices(import_libraries=True))
    comm = MPI.COMM_WORLD if comm is None else comm
    node, node_index, _ = node_of(comm)
    try:
        return _bind(policy, comm, node.Get_rank(), node.Get_size(), node_index, _find_devices(import_libraries=True))
    finally:
        node.Free()


def node_roots(shared_roots, hosts):
    """Return each rank's node as its lowest rank: ranks sharing memory or a host name are on one node.

    ``shared_roots[r]`` is the lowest rank of rank ``r``'s shared-memory
    communicator, ``hosts[r]`` its processor name. MPI's shared-memory split is
    usually the node; where it is finer (no process mapping from the launcher:
    every rank alone), the host name joins the ranks; where it is coarser
    (containers with their own host names on one machine), the machine is the
    node. Local, pure.
    """
    parent = list(range(len(hosts)))

    def find(r):
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first_of_host = {}
    for rank, (root, host) in enumerate(zip(shared_roots, hosts)):
        for other in (root, first_of_host.setdefault(host, rank)):
            a, b = find(rank), find(other)
            parent[max(a, b)] = min(a, b)
    return [find(rank) for rank in range(len(hosts))]


def node_of(comm):
    """Return ``(node communicator, node index, number of nodes)`` for this rank of ``comm``: the one node rule.

    Ranks sharing memory or a host name are on one node (:func:`node_roots`);
    the node communicator orders them by rank (node-local rank 0 is the
    lowest), nodes are indexed by their lowest rank. Collective over ``comm``
    (one allgather); the caller frees the communicator.
    """
    MPI = mpi()
    rank = comm.Get_rank()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    # The node's lowest rank is its node-local rank 0 (Split_type was keyed by rank): no collective.
    node_group, world_group = node.Get_group(), comm.Get_group()
    shared_root = node_group.Translate_ranks([0], world_group)[0]
    node_group.Free()
    world_group.Free()
    gathered = comm.allgather((shared_root, MPI.Get_processor_name()))
    nodes = node_roots([root for root, _ in gathered], [host for _, host in gathered])
    if nodes != [root for root, _ in gathered]:
        # MPI split a host into several shared-memory domains (srun -m arbitrary over pmi2
        # gives MPICH no process mapping): the host is the node. Alike on every rank.
        node.Free()
        node = comm.Split(nodes[rank], rank)
    distinct_roots = sorted(set(nodes))
    return node, distinct_roots.index(nodes[rank]), len(distinct_roots)

"""GPU binding: the policies and the sharing warning, with injected device lists; real CUDA where present."""

import socket
import warnings

import pytest
from mpi4py import MPI

import mpidomain
from mpidomain import binding
from mpidomain.binding import _Devices, _shared


class FakeDevices(_Devices):
    """``count`` visible devices whose physical identities are ``identities[i]``; records selections."""

    def __init__(self, identities, current=0):
        self.selected = []
        super().__init__("fake", len(identities), lambda: current, self.selected.append,
                         lambda i: identities[i])


def node_comm(world):
    return world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)


def inject(monkeypatch, devices):
    monkeypatch.setattr(binding, "_find_devices", lambda import_libraries: devices)
    return devices


def bind(policy, **kwargs):
    """bind_device, returning (binding, warning messages seen on this rank)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = mpidomain.bind_device(policy, **kwargs)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_auto_is_local_rank_modulo_device_count(world, monkeypatch):
    host = socket.gethostname()
    devices = inject(monkeypatch, FakeDevices([f"GPU-{host}-a", f"GPU-{host}-b"]))
    node = node_comm(world)
    result, messages = bind("auto")
    assert result.device == node.rank % 2 and devices.selected == [node.rank % 2]
    assert result.identity == f"GPU-{host}-{'ab'[node.rank % 2]}" and result.library == "fake"
    same_gpu = [r for d, h, r in world.allgather((node.rank % 2, host, world.rank)) if (d, h) == (node.rank % 2, host)]
    assert sorted(result.shared_with) == sorted(r for r in same_gpu if r != world.rank)
    # More ranks on the node than GPUs: rank 0 warns, naming the ranks that share.
    largest = world.allreduce(node.size, op=MPI.MAX)
    if world.rank == 0 and node.size > 2:
        assert len(messages) == 1 and "ranks 0,2" in messages[0], messages
    elif world.rank == 0 and largest > 2:
        assert len(messages) == 1, messages  # another node's ranks share
    else:
        assert messages == []
    node.Free()


def test_launcher_gave_each_rank_its_own_gpu(world, monkeypatch):
    # CUDA_VISIBLE_DEVICES per rank: each sees one device, index 0, a different GPU.
    devices = inject(monkeypatch, FakeDevices([f"GPU-{socket.gethostname()}-{world.rank}"]))
    result, messages = bind("auto")
    assert (result.device, result.shared_with, messages) == (0, (), [])
    assert devices.selected == [0]


def test_launcher_gave_every_rank_the_same_gpu(world, monkeypatch):
    inject(monkeypatch, FakeDevices(["GPU-one"]))
    result, messages = bind("auto")
    hosts = world.allgather(socket.gethostname())
    assert result.shared_with == tuple(r for r in range(world.size) if r != world.rank and hosts[r] == hosts[world.rank])
    sharing = [r for r in range(world.size) if hosts.count(hosts[r]) > 1]
    if world.rank == 0 and sharing:
        assert len(messages) == 1 and f"ranks {','.join(map(str, sharing))} on GPU-one" in messages[0], messages
        assert "one rank per GPU" in messages[0]
    else:
        assert messages == []


def test_explicit_list_shares_on_purpose(world, monkeypatch):
    devices = inject(monkeypatch, FakeDevices(["GPU-x", "GPU-y"]))
    node = node_comm(world)
    result, messages = bind([1] * world.allreduce(node.size, op=MPI.MAX))  # the same list on every node
    assert result.device == 1 and devices.selected == [1] and messages == []
    assert len(result.shared_with) == node.size - 1
    node.Free()


def test_none_reports_the_current_device(world, monkeypatch):
    devices = inject(monkeypatch, FakeDevices(["GPU-x", f"GPU-{world.rank}"], current=1))
    result, messages = bind("none")
    assert (result.device, result.identity, devices.selected, messages) == (1, f"GPU-{world.rank}", [], [])


def test_without_cuda_every_rank_is_unbound(world, monkeypatch):
    inject(monkeypatch, None)
    result, messages = bind("auto")
    assert (result.device, result.describe(), messages) == (None, "no CUDA device", [])


@pytest.mark.parametrize("policy", ["gpu", [], [-1], [0.5], True])
def test_bad_policies_are_errors_everywhere(world, monkeypatch, policy):
    inject(monkeypatch, FakeDevices(["GPU-x"]))
    with pytest.raises(ValueError, match="bind_device must be 'auto', 'none' or a list"):
        mpidomain.bind_device(policy)


def test_list_too_short_or_naming_missing_devices(world, monkeypatch):
    inject(monkeypatch, FakeDevices(["GPU-x", "GPU-y"]))
    node = node_comm(world)
    largest = world.allreduce(node.size, op=MPI.MAX)
    if largest > 1:
        with pytest.raises(ValueError, match=f"names a device for 1 node-local ranks, but .* runs {largest}"):
            mpidomain.bind_device([0])
    with pytest.raises(ValueError, match="device 2, but .* shows this rank 2 CUDA device"):
        mpidomain.bind_device([2] * largest)
    node.Free()


def test_ranks_must_agree_on_the_policy(world, monkeypatch):
    inject(monkeypatch, FakeDevices(["GPU-x"]))
    if world.size > 1:
        with pytest.raises(ValueError, match="bind_device must be the same on every rank"):
            mpidomain.bind_device("auto" if world.rank == 0 else "none")


def test_sharing_is_per_node_and_per_physical_gpu():
    # (node, local rank, device index, identity) for ranks 0-4 on two nodes.
    reports = [(0, 0, 0, "PCI 0000:3b:00"), (0, 1, 1, "PCI 0000:3b:00"), (1, 0, 0, "PCI 0000:3b:00"),
               (1, 1, 1, "PCI 0000:5e:00"), (1, 2, None, "")]
    shared, unasked = _shared(reports, "auto")
    # Same bus id on two nodes is two GPUs; two indices naming one GPU (node 0) is sharing.
    assert shared == {0: (1,), 1: (0,)} and unasked == [[0, 1]]
    assert _shared(reports, [0, 0, 0])[1] == []  # a list giving both local ranks device 0 asked for it
    assert _shared(reports, [0, 1, 0])[1] == [[0, 1]]


def test_manager_binds_when_cuda_is_available(world, monkeypatch, fresh_manager):
    devices = inject(monkeypatch, FakeDevices(["GPU-x", "GPU-y", "GPU-z"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 4 ranks on 3 GPUs
        manager = mpidomain.initialize_domain_parallel(world.size, 1, abort_on_error=False)
        assert manager.device_binding.device == manager.local_rank % 3 == devices.selected[0]
        devices.selected.clear()
        manager = mpidomain.initialize_domain_parallel(world.size, 1, abort_on_error=False, bind_device=[0] * 64)
    assert manager.device_binding.device == 0 and devices.selected == [0]
    devices.selected.clear()
    manager = mpidomain.initialize_domain_parallel(world.size, 1, abort_on_error=False, bind_device="none")
    assert manager.device_binding is None and devices.selected == []


def test_info_reports_the_device(world, monkeypatch, capsys, fresh_manager):
    from mpidomain.__main__ import main

    inject(monkeypatch, FakeDevices(["GPU-0123456789abcdef"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(["info"]) == 0
    out = capsys.readouterr().out
    if world.rank == 0:
        assert "cuda:0(GPU-01234567" in out, out


def cuda_everywhere(world):
    try:
        import torch
    except ImportError:
        return False
    return bool(world.allreduce(int(torch.cuda.is_available()), op=MPI.MIN))


def test_real_cuda_binding(world):
    if not cuda_everywhere(world):
        pytest.skip("needs torch with CUDA on every rank")
    import torch

    node = node_comm(world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = mpidomain.bind_device("auto")
    assert result.library == "torch" and result.device == node.rank % torch.cuda.device_count()
    assert torch.cuda.current_device() == result.device
    assert result.identity.startswith(("GPU-", "PCI "))
    node.Free()


def test_manager_rejects_a_bad_policy_before_building(world, fresh_manager):
    with pytest.raises(ValueError, match="bind_device must be 'auto', 'none' or a list"):
        mpidomain.DomainParallelManager(world.size, 1, bind_device="gpu0")
    if world.size > 1:
        with pytest.raises(ValueError, match="bind_device\\) must be the same on every rank"):
            mpidomain.DomainParallelManager(world.size, 1, bind_device="auto" if world.rank else "none")

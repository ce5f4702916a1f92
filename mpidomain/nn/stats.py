"""``CommStats``: the bytes this rank sends, by kind of message and of layer, while a context is open.

The library's senders report to :mod:`mpidomain.comm_stats` only while a
recorder is open; :class:`CommStats` opens one and names the layer each message
belongs to. In forward, the innermost domain-parallel layer being run (global
module hooks, installed only while the context is open). In backward, the layer
whose forward made the autograd node being run: when a layer's forward returns,
the nodes it created are tagged with its kind (``node.metadata``), and the
node running a backward message is read off autograd's current node.

Counts are deterministic: they follow from the layers, the shapes and the
layout, not from timing. What a rank "sends": a halo exchange's messages
(forward, and the ghost rows' gradients sent back in backward), the rows of a
re-distribution that leave the rank, the buffer of an all-reduce once (what the
rank contributes; the MPI algorithm moves a small multiple of it: a ring about
2 (D-1)/D times), and the agreement steps' and extents' few integers
(``control``). A group of one rank sends nothing.
"""

import torch

from .. import comm_stats
from .._current import require_manager

__all__ = ["CommStats", "LABELS", "layer_kind"]

_KEY = "mpidomain.comm_stats"  # the autograd node metadata key: (module call number, kind)

#: Row labels, in table order: (op, layer kind) -> label.
LABELS = {
    ("halo", "conv"): "halo exchange: convolutions",
    ("halo", "pool"): "halo exchange: pools",
    ("halo", "other"): "halo exchange: other (padding, interpolation)",
    ("alltoall", "attention"): "all-to-all: window attention",
    ("alltoall", "other"): "all-to-all: other (padding)",
    ("allreduce", "norm"): "all-reduce: normalisation statistics",
    ("allreduce", "gradients"): "all-reduce: gradients",
    ("allreduce", "other"): "all-reduce: other (pools, losses)",
    ("control", "other"): "control: agreement steps, extents",
}
_GENERIC = ("HaloExchange", "Redistribute")  # movers whose kind is the layer around them


def layer_kind(module):
    """Return the kind of a domain-parallel layer (``conv``, ``pool``, ``norm``, ``attention``, ``other``), or None
    for a module that is not one of mpidomain's layers (or a generic mover). Local."""
    kind = type(module)
    if not kind.__module__.startswith("mpidomain.") or kind.__name__ in _GENERIC:
        return None
    name = kind.__name__
    if "WindowAttention" in name:
        return "attention"
    for part, label in (("Conv", "conv"), ("Pool", "pool"), ("Norm", "norm")):
        if part in name:
            return label
    return "other"


def _label(op, kind):
    if op == "control":
        kind = "other"
    elif op == "halo" and kind not in ("conv", "pool"):
        kind = "other"
    elif op == "alltoall" and kind != "attention":
        kind = "other"
    elif op == "allreduce" and kind not in ("norm", "gradients"):
        kind = "other"
    return LABELS[(op, kind)]


class CommStats:
    """Count the bytes this rank sends while open, by kind: ``with CommStats(manager) as stats: <one step>``.

    ``stats.by_kind`` ({label: bytes}, labels of :data:`LABELS`), ``stats.messages`` ({label: calls}),
    ``stats.total`` (bytes), ``stats.wait_seconds`` (time spent completing MPI requests and in blocking
    collectives), ``stats.table()``; divided by ``steps`` (the steps run inside). Off by default: with no
    CommStats open the senders pay one attribute test. One may be open at a time. Local (counting sends
    nothing; each rank counts its own messages).

    :param manager: The manager whose layers run inside (default: the current one); its domain group's
        size and this rank name the table.
    :param steps: How many steps run inside the context (counts are per step).
    """

    def __init__(self, manager=None, steps=1):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"CommStats(steps=...) takes the number of steps run inside, an int >= 1, got "
                             f"{steps!r}; pass steps=1 for one step")
        self.manager = require_manager(manager, "CommStats")
        self.steps = steps
        self._recorder = comm_stats.Recorder(self._classify)
        self._timer = comm_stats.WaitTimer()
        self._stack = []  # (call number, kind, stop nodes) of the layers being run, innermost last
        self._calls = 0
        self._hooks = []

    # -- which layer a message belongs to -------------------------------------------
    def _classify(self, op):
        node = torch._C._current_autograd_node()
        if node is not None:  # in backward: the layer whose forward made this node
            return node.metadata.get(_KEY, (0, "other"))[1]
        return self._stack[-1][1] if self._stack else "other"

    def _enter_layer(self, module, args):
        kind = layer_kind(module)
        if kind is not None:
            self._calls += 1
            stops = {t.grad_fn for t in _tensors(args) if t.grad_fn is not None}
            self._stack.append((self._calls, kind, stops, module))

    def _leave_layer(self, module, args, output):
        if not self._stack or self._stack[-1][3] is not module:
            return
        number, kind, stops, _ = self._stack.pop()
        # Tag the autograd nodes this layer's forward made (those of layers inside it keep theirs).
        pending = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        seen = set()
        while pending:
            node = pending.pop()
            if node is None or node in seen or node in stops:
                continue
            seen.add(node)
            tag = node.metadata.get(_KEY)
            if tag is not None and tag[0] < number:
                continue  # an earlier layer's node: upstream of this one
            if tag is None:
                node.metadata[_KEY] = (number, kind)
            pending.extend(next_node for next_node, _ in node.next_functions)

    # -- the context ---------------------------------------------------------------
    def __enter__(self):
        self._recorder.__enter__()
        modules = torch.nn.modules.module
        try:
            self._hooks = [modules.register_module_forward_pre_hook(self._enter_layer),
                           modules.register_module_forward_hook(self._leave_layer)]
        except BaseException:
            self._recorder.__exit__(None, None, None)
            raise
        self._timer.__enter__()
        return self

    def __exit__(self, *exc):
        self._timer.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._stack = [], []
        self._recorder.__exit__(*exc)
        return False

    # -- the counts ----------------------------------------------------------------
    def _per_step(self, counts):
        out = {}
        for (op, kind), value in counts.items():
            label = _label(op, kind)
            out[label] = out.get(label, 0) + value
        ordered = {label: out[label] / self.steps for label in dict.fromkeys(LABELS.values()) if label in out}
        return {label: int(v) if float(v).is_integer() else v for label, v in ordered.items()}

    @property
    def by_kind(self):
        """{label: bytes this rank sent per step}, in :data:`LABELS` order, kinds with none left out."""
        return self._per_step(self._recorder.bytes)

    @property
    def messages(self):
        """{label: sends (calls) per step}: a halo exchange, an all-to-all, an all-reduce each count once."""
        return self._per_step(self._recorder.messages)

    @property
    def total(self):
        """Bytes this rank sent per step, every kind."""
        return sum(self.by_kind.values())

    @property
    def wait_seconds(self):
        """Seconds per step this rank spent completing MPI requests and in blocking collectives."""
        return self._timer.seconds / self.steps

    def table(self):
        """Return the counts as text: one line per kind (bytes per step, MiB, share, calls), then the total."""
        manager = self.manager
        lines = [f"rank {manager.rank} of a domain group of {manager.domain_parallel_size}: bytes sent per step"]
        total = self.total
        calls = self.messages
        for label, nbytes in self.by_kind.items():
            share = nbytes / total if total else 0.0
            lines.append(f"  {label:<48} {nbytes:>14,} B {nbytes / 2**20:>10.3f} MiB {100 * share:6.1f} %"
                         f" {calls[label]:>6} calls")
        lines.append(f"  {'total':<48} {total:>14,} B {total / 2**20:>10.3f} MiB")
        return "\n".join(lines)


def _tensors(value):
    """The tensors in ``value`` (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []

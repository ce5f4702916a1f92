"""Turn a single-process PyTorch model into a domain-parallel one, in place, or refuse.

Every module is decided by the first rule that matches it: ``allow_local``,
then your ``rules`` and ``custom_converters``, then
:data:`~mpidomain.nn.builtin_rules.BUILTIN_RULES`; ``docs/converter-rules.md``
lists them all (:func:`~mpidomain.nn.rules_table` writes that table). A rule's
:class:`~mpidomain.nn.Decision` is convert (the replacement), local (kept, with
why it is exact on a shard), refuse (with why) or visit (its children are
decided). In an ``nn.Sequential`` an ``nn.ZeroPad2d`` directly before an
unpadded ``Conv2d`` hands its sharded-dim padding to the wrapped convolution.
Before the modules, CREDIT's ``TensorPadding`` objects held as attributes
(``model.padding_opt``) become :class:`~mpidomain.nn.DomainParallelTensorPadding`
and a CrossFormer's final ``F.interpolate``, the identity, is switched off
(:mod:`mpidomain.nn.padded_models`).

Refused modules raise one ValueError naming every path and why. The decision
is local and deterministic (no communication): every rank converts the same
model, so every rank raises the same error. State dict keys do not change, so
a checkpoint of the model before conversion loads into the converted model and back.
"""

from dataclasses import dataclass

import torch

from .._current import require_manager
from ..manager import get_domain_parallel_manager
from ._shard import shard_dims
from .builtin_rules import BUILTIN_RULES, LOCAL_REASONS, allow_local_rule, axis_of, child_reasons
from .conv import DomainParallelConv2d, conv_padding
from .padded_models import plan_padded_models
from .rng import check_rng
from .rule import Decision, Rule, RuleContext

__all__ = ["ConversionReport", "LOCAL_REASONS", "convert_to_domain_parallel"]

nn = torch.nn


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_to_domain_parallel` did: ``converted`` (path, replacement) and ``local`` (path, why) pairs.

    Paths are those of ``model.named_modules()`` before conversion (``""`` is the model itself).
    """

    converted: tuple
    local: tuple

    def __str__(self):
        lines = [f"converted ({len(self.converted)}):"]
        lines += [f"  {path or '<model>'}: {what}" for path, what in self.converted]
        lines.append(f"left local ({len(self.local)}):")
        lines += [f"  {path or '<model>'}: {why}" for path, why in self.local]
        return "\n".join(lines)


def _custom_rule(base, factory):
    """``custom_converters``' ``{base: factory}`` entry as a rule: ``factory(module)`` replaces the module."""
    name = f"custom_converters[{base.__name__}]"

    def action(module, context):
        replacement = factory(module)
        if not isinstance(replacement, nn.Module):
            raise TypeError(f"{name} returned {type(replacement).__name__} for {context.path or '<model>'}, expected "
                            "the torch.nn.Module that replaces it; make the factory return the converted module")
        return Decision.convert(replacement, "custom_converters")

    return Rule(name, base, action)


def _user_rules(rules, custom_converters):
    """Your ``rules`` (checked), then ``custom_converters`` as rules."""
    if isinstance(rules, Rule):
        rules = (rules,)
    rules = tuple(rules or ())
    for index, rule in enumerate(rules):
        if not isinstance(rule, Rule):
            raise TypeError(f"rules must hold mpidomain.nn.Rule objects, got {type(rule).__name__} at index {index}; "
                            "e.g. rules=[Rule(\"my layer\", MyLayer, Decision.local(\"acts on channels only\"))]")
    converters = dict(custom_converters or {})
    for key in converters:
        if not isinstance(key, type):
            raise TypeError(f"custom_converters keys must be module types, got {key!r}")
    return rules + tuple(_custom_rule(base, factory) for base, factory in converters.items())


def _pad_before_conv(sequential, index, shard_dim, manager):
    """For ``ZeroPad2d`` at ``index`` followed by an unpadded ``Conv2d``: the (pad, conv) replacements, or None."""
    pad, conv = sequential[index], sequential[index + 1]
    if not (type(pad) is nn.ZeroPad2d and isinstance(conv, nn.Conv2d)
            and conv_padding(conv) == [(0, 0), (0, 0)]):
        return None
    left, right, top, bottom = pad.padding
    along = [(top, bottom) if axis_of(conv, d) == 0 else (left, right) for d in shard_dims(shard_dim)]
    axes = {axis_of(conv, d) for d in shard_dims(shard_dim)}
    kept = nn.ZeroPad2d((0 if 1 in axes else left, 0 if 1 in axes else right,
                         0 if 0 in axes else top, 0 if 0 in axes else bottom))
    padding = along[0] if len(along) == 1 else tuple(along)
    return kept, DomainParallelConv2d(conv, shard_dim, manager, padding=padding)


class _Walk:
    """One conversion: the rules' decisions, the replacements to install, the report and the refusals."""

    def __init__(self, rules, shard_dim, manager, allowed_paths, rng):
        self.rules, self.shard_dim, self.manager, self.allowed_paths = rules, shard_dim, manager, allowed_paths
        self.rng = rng
        self.converted, self.local, self.refused, self.installs = [], [], [], []

    def module(self, module, path, reasons=None):
        """Decide ``module`` at ``path`` by the first rule that matches; return its replacement or None (it stays)."""
        context = RuleContext(path, self.shard_dim, self.manager, dict(reasons or {}), self.rng)
        rule = next(rule for rule in self.rules if rule.matches(module, context))
        decision = rule.decide(module, context)
        name = type(module).__name__
        if decision.kind == "convert":
            note = f" ({decision.reason})" if decision.reason else ""
            self.converted.append((path, f"{name} -> {type(decision.replacement).__name__}{note}"))
            return decision.replacement
        why = f"{name}: {decision.reason}" if decision.typed else decision.reason
        if decision.kind == "local":
            self.local.append((path, why))
        elif decision.kind == "refuse":
            self.refused.append((path, why))
        else:
            if decision.reason is not None:
                self.local.append((path, why))
            self.children(module, path)
        return None

    def children(self, parent, path):
        reasons = child_reasons(parent)
        names = [name for name, child in parent._modules.items() if child is not None]
        prefix = f"{path}." if path else ""
        index = 0
        while index < len(names):
            name = names[index]
            if isinstance(parent, nn.Sequential) and index + 1 < len(names) and \
                    f"{prefix}{name}" not in self.allowed_paths:
                pair = _pad_before_conv(parent, index, self.shard_dim, self.manager)
                if pair is not None:
                    following = names[index + 1]
                    self.installs += [(parent, name, pair[0]), (parent, following, pair[1])]
                    self.local.append((f"{prefix}{name}", f"ZeroPad2d: {LOCAL_REASONS['pad']} (its sharded-dim "
                                                          f"padding moved into {prefix}{following})"))
                    self.converted.append((f"{prefix}{following}", "Conv2d -> DomainParallelConv2d (with the "
                                                                   "ZeroPad2d's padding)"))
                    index += 2
                    continue
            replacement = self.module(parent._modules[name], f"{prefix}{name}", reasons)
            if replacement is not None:
                self.installs.append((parent, name, replacement))
            index += 1


def _allowed(allow_local):
    """``allow_local`` split into (paths, types); TypeError naming a wrong entry."""
    if isinstance(allow_local, (str, type)):
        allow_local = (allow_local,)
    paths, types = set(), []
    for entry in allow_local:
        if isinstance(entry, str):
            paths.add(entry)
        elif isinstance(entry, type):
            types.append(entry)
        else:
            raise TypeError(f"allow_local entries must be module paths (str) or module types, got {entry!r}")
    return paths, tuple(types)


def _shard_dim(shard_dim, manager):
    if shard_dim is None:
        found = manager if manager is not None else get_domain_parallel_manager()
        shard_dim = -2 if found is None else found.shard_dim
    dims = shard_dims(shard_dim)
    if not (0 < len(dims) <= 2 and all(isinstance(d, int) and not isinstance(d, bool) and d < 0 for d in dims)
            and list(dims) == sorted(set(dims))):
        raise ValueError(f"shard_dim must be a negative int counted from the last dim (e.g. -2), or a pair such as "
                         f"(-2, -1) for tiles, got {shard_dim!r}")
    return shard_dim


def convert_to_domain_parallel(model, manager=None, shard_dim=None, custom_converters=None, *, rules=(),
                               allow_local=(), report=False, rng="tile"):
    """Replace ``model``'s layers that need other ranks' rows by domain-parallel ones; return ``model``.

    Local and deterministic (no communication): every rank converts the same
    model and takes the same decisions, so a refusal raises the same
    ValueError on every rank. The converted model's forward and backward are
    collective over the domain group. The rules: ``docs/converter-rules.md``
    (:func:`~mpidomain.nn.rules_table`).

    :param model: A ``torch.nn.Module``, changed in place (a bare convertible layer is returned converted).
    :param manager: The manager the layers use; default: the global one when they run.
    :param shard_dim: The sharded dim of the layers' inputs (-2: latitude of (B, C, H, W) and (B, C, T, H, W)),
        or the pair ``(-2, -1)`` for tiles. Default: the manager's ``shard_dim`` (``manager``, else the
        global one if initialised, else -2).
    :param custom_converters: ``{type: factory}``, ``factory(module) -> replacement``: rules tried after
        ``rules``, matched with ``isinstance`` in order (the report notes "(custom_converters)").
    :param rules: :class:`~mpidomain.nn.Rule` objects tried first (after ``allow_local``), in order, before the
        built-in rules: the first that matches a module decides it.
    :param allow_local: Module paths (as ``model.named_modules()`` names them, e.g. ``"blocks.0.norm"``) or
        module types to leave as they are, children included, for modules the converter would refuse
        but you know to be local along the sharded dims.
    :param report: If True, return ``(model, ConversionReport)``: every converted path with its
        replacement, every path left local with why.
    :param rng: How the converted dropouts draw (:mod:`mpidomain.nn.rng`): ``"tile"`` (default), each rank
        its shard's mask from its own stream, seeded from torch's default generator and the rank's place;
        ``"one-process"``, bitwise the masks one process draws from the same generator state, in the same
        order, at any layout, the generator left where one process leaves it (a whole field's mask per
        dropout call, transient). Either way torch's default generator advances alike on every rank of a
        domain group. A random layer that ``"one-process"`` cannot reproduce is refused by name.
    :raises ValueError: Naming every module the converter cannot make exact (its path, type and why),
        before anything is changed.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if manager is not None:
        require_manager(manager, "convert_to_domain_parallel")
    shard_dim = _shard_dim(shard_dim, manager)
    rng = check_rng(rng)
    user = _user_rules(rules, custom_converters)
    paths, types = _allowed(allow_local)
    padded = plan_padded_models(model, manager)  # raises before anything changes
    walk = _Walk((allow_local_rule(paths, types),) + user + BUILTIN_RULES, shard_dim, manager, paths, rng)
    root = walk.module(model, "")
    unknown = sorted(paths - {name for name, _ in model.named_modules()})
    if unknown:
        raise ValueError(f"allow_local names {unknown}, which are not module paths of the model (paths are "
                         f"model.named_modules() names, e.g. {[n for n, _ in model.named_modules()][1:4]})")
    if walk.refused:
        listing = "\n".join(f"  {path or '<model>'} ({why})" for path, why in walk.refused)
        raise ValueError(
            f"convert_to_domain_parallel cannot make {len(walk.refused)} module(s) exact on shards, and leaves "
            f"nothing local silently:\n{listing}\nConvert them yourself (custom_converters={{type: factory}}), use "
            "a module form the converter knows, or, if a module is local along the sharded dims in your model, "
            "pass its path or type in allow_local=(...)"
        )
    for parent, name, replacement in walk.installs:
        parent._modules[name] = replacement
    for module, name, value, path, what in padded:
        setattr(module, name, value)
        walk.converted.append((path, what))
    result = model if root is None else root
    if report:
        return result, ConversionReport(tuple(walk.converted), tuple(walk.local))
    return result

"""The converter's rule type: which modules a rule matches, and its decision on each of them.

:func:`~mpidomain.nn.convert_to_domain_parallel` decides every module by the
first :class:`Rule` that matches it (yours first, then :data:`BUILTIN_RULES
<mpidomain.nn.builtin_rules.BUILTIN_RULES>`); the rule returns one of four
:class:`Decision` kinds: convert, local (with why), refuse (with why) or visit
(decide its children). Pure Python: no communication, alike on every rank.
"""

from dataclasses import dataclass, field

import torch

__all__ = ["Decision", "KINDS", "Rule", "RuleContext", "markdown_table"]

#: The four decisions, in the order the table lists them.
KINDS = ("convert", "local", "refuse", "visit")


@dataclass(frozen=True)
class Decision:
    """Say what a rule decides for one module; make one with :meth:`convert`, :meth:`local`, :meth:`refuse`, ...

    ``kind`` is one of :data:`KINDS`; ``replacement`` the module that takes its place (convert only);
    ``reason`` why it is local or refused, why a visited module's own forward is left (or None), or a
    note after a conversion in the report; ``typed``: the report prefixes the module's type name.
    """

    kind: str
    replacement: object = None
    reason: str = None
    typed: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Decision kind must be one of {KINDS}, got {self.kind!r}; use Decision.convert, "
                             ".local, .refuse or .visit")
        if self.kind == "convert" and not isinstance(self.replacement, torch.nn.Module):
            raise TypeError(f"Decision.convert takes the replacement torch.nn.Module, got "
                            f"{type(self.replacement).__name__}; return the domain-parallel module your rule built")
        if self.kind in ("local", "refuse") and not (isinstance(self.reason, str) and self.reason):
            raise TypeError(f"Decision.{self.kind} takes the reason as a non-empty str, got {self.reason!r}; say why "
                            f"the module is {'exact locally' if self.kind == 'local' else 'refused and the fix'}")

    @classmethod
    def convert(cls, replacement, note=None):
        """Replace the module by ``replacement`` (its children are left as they are); ``note`` follows in the report."""
        return cls("convert", replacement, note)

    @classmethod
    def local(cls, reason, typed=True):
        """Keep the module as it is, children included: ``reason`` says why it is exact on each rank's shard.

        ``typed=False``: the report gives ``reason`` alone, not after the module's type name.
        """
        return cls("local", None, reason, typed)

    @classmethod
    def refuse(cls, reason):
        """Refuse the module: ``reason`` says why it cannot be made exact and what to do instead."""
        return cls("refuse", None, reason)

    @classmethod
    def visit(cls, reason=None):
        """Keep the module and decide its children; ``reason`` (if any) reports why its own forward is left."""
        return cls("visit", None, reason)


@dataclass(frozen=True)
class RuleContext:
    """Tell a rule where it applies: the module's ``path`` (``""`` for the model), ``shard_dim`` and ``manager``.

    ``shard_dim`` and ``manager`` are what the converted layers take (``manager`` may be None: the global
    one when they run); ``child_reasons`` maps child names the parent's structure makes local to why;
    ``rng`` is how random layers draw (``"tile"`` or ``"one-process"``, :mod:`mpidomain.nn.rng`).
    """

    path: str
    shard_dim: object
    manager: object = None
    child_reasons: dict = field(default_factory=dict)
    rng: str = "tile"

    @property
    def name(self):
        """The module's own name in its parent (the last part of ``path``)."""
        return self.path.rpartition(".")[2]


def _type_names(types):
    return ", ".join(f"`{t.__name__}`" for t in types)


@dataclass(frozen=True)
class Rule:
    """Make a converter rule: modules that ``match`` get the :class:`Decision` of ``action``.

    :param name: A short name (the report and the table use it).
    :param match: A module type or a tuple of types (``isinstance``), or ``match(module, context) -> bool``.
    :param action: A :class:`Decision` (the same for every match), or ``action(module, context) -> Decision``
        (``context`` is a :class:`RuleContext`: ``path``, ``shard_dim``, ``manager``).
    :param layer: What it matches, for the table (default: the type names, or ``name``).
    :param outcomes: ``(kind, condition, reason)`` rows for the table, one per decision it can take
        (default: one row, the constant action's, or ``("convert", "", "")``).
    """

    name: str
    match: object
    action: object
    layer: str = None
    outcomes: tuple = ()

    def __post_init__(self):
        if not (isinstance(self.name, str) and self.name):
            raise TypeError(f"Rule name must be a non-empty str, got {self.name!r}; name it after what it matches")
        if not (self._types() is not None or callable(self.match)):
            raise TypeError(f"Rule {self.name!r}: match must be a module type, a tuple of types or a callable "
                            f"(module, context) -> bool, got {self.match!r}")
        if not (isinstance(self.action, Decision) or callable(self.action)):
            raise TypeError(f"Rule {self.name!r}: action must be a Decision or a callable (module, context) -> "
                            f"Decision, got {self.action!r}; e.g. Decision.local(\"acts on channels only\")")
        for row in self.outcomes:
            if not (isinstance(row, tuple) and len(row) == 3 and row[0] in KINDS):
                raise TypeError(f"Rule {self.name!r}: outcomes must be (kind, condition, reason) tuples with kind in "
                                f"{KINDS}, got {row!r}")

    def _types(self):
        """The matched types, or None if ``match`` is a predicate."""
        if isinstance(self.match, type):
            return (self.match,)
        if isinstance(self.match, tuple) and self.match and all(isinstance(t, type) for t in self.match):
            return self.match
        return None

    def matches(self, module, context):
        """Return True if this rule applies to ``module`` at ``context``."""
        types = self._types()
        return isinstance(module, types) if types is not None else bool(self.match(module, context))

    def decide(self, module, context):
        """Return this rule's :class:`Decision` for ``module`` (which it matches); TypeError if it is not one."""
        decision = self.action if isinstance(self.action, Decision) else self.action(module, context)
        if not isinstance(decision, Decision):
            raise TypeError(f"rule {self.name!r} returned {type(decision).__name__} for "
                            f"{context.path or '<model>'} ({type(module).__name__}), expected a Decision; return "
                            "Decision.convert(new_module), Decision.local(why), Decision.refuse(why) or "
                            "Decision.visit()")
        return decision

    def table_rows(self):
        """Return this rule's ``(layer, kind, condition, reason)`` rows for :func:`markdown_table`."""
        types = self._types()
        layer = self.layer or (_type_names(types) if types is not None else self.name)
        outcomes = self.outcomes
        if not outcomes:
            fixed = self.action if isinstance(self.action, Decision) else None
            outcomes = ((fixed.kind, "", fixed.reason or ""),) if fixed else (("convert", "", ""),)
        return [(layer, kind, condition, reason) for kind, condition, reason in outcomes]


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(rules):
    """Return ``rules`` as a markdown table: number, layer, decision, condition, reason, first rule first."""
    lines = ["| # | layer | decision | condition | reason |", "|---|---|---|---|---|"]
    for number, rule in enumerate(rules, 1):
        for layer, kind, condition, reason in rule.table_rows():
            lines.append(f"| {number} | {_cell(layer)} | {kind} | {_cell(condition)} | {_cell(reason)} |")
    return "\n".join(lines) + "\n"

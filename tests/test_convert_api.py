"""The converter's public rule API: user rules of each decision, their order, DomainParallelModule, mistakes.

Every test is collective (the suite agrees verdicts); conversion itself is local, so the decisions and
messages are compared across ranks too.
"""

import copy

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from mpidomain import DomainParallelManager  # noqa: E402
from mpidomain.models import RULES, UNet  # noqa: E402
from mpidomain.nn import (BUILTIN_RULES, Decision, DomainParallelConv2d, DomainParallelModule,  # noqa: E402
                          DomainParallelPeriodicConv2d, HaloExchange, Rule, RuleContext, convert_to_domain_parallel,
                          rules_table)
from mpidomain.nn.builtin_rules import table_rules  # noqa: E402
from mpitest import divisors  # noqa: E402
from test_layers import compare, counts_for  # noqa: E402

nn = torch.nn


class Blur(nn.Module):
    """Each row's mean with its latitude neighbours (zeros beyond the edges)."""

    @staticmethod
    def mean3(padded):
        return (padded[..., :-2, :] + padded[..., 1:-1, :] + padded[..., 2:, :]) / 3

    def forward(self, x):
        return self.mean3(F.pad(x, (0, 0, 1, 1)))


class DomainParallelBlur(DomainParallelModule):
    """Blur on latitude shards through a halo exchange of one row."""

    def __init__(self, blur, shard_dim, manager):
        super().__init__(blur, shard_dim, manager)
        self.halo = HaloExchange(1, shard_dim, manager=manager)

    def forward(self, x):
        return self.module.mean3(self.halo(x))


class Scale(nn.Module):
    """A leaf with a parameter, local per channel."""

    def __init__(self, channels=2):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(channels, 1, 1))

    def forward(self, x):
        return x * self.scale


class Mix(nn.Module):
    """A leaf the user knows mixes rows: refused by their own rule."""

    def forward(self, x):
        return x.flip(-2)


class Holder(nn.Module):
    """A user block: visited by the user's rule, with its own note."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.conv(x))


def blur_rule():
    return Rule("blur", Blur, lambda module, context: Decision.convert(
        DomainParallelBlur(module, context.shard_dim, context.manager), "halo of 1 row"))


def all_kinds():
    return [
        blur_rule(),
        Rule("scale", Scale, Decision.local("scales each channel")),
        Rule("mix", Mix, Decision.refuse("flips latitude; convert it with a halo-free gather instead")),
        Rule("holder", Holder, Decision.visit("its forward only chains its children")),
    ]


def kinds_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), Blur(), Scale(), Holder(), Mix())


def test_a_user_rule_of_each_kind_decides_its_modules_alike_on_every_rank(world):
    with pytest.raises(ValueError) as caught:
        convert_to_domain_parallel(kinds_model(), rules=all_kinds())
    message = str(caught.value)
    assert "cannot make 1 module(s) exact" in message
    assert "  4 (Mix: flips latitude; convert it with a halo-free gather instead)" in message
    model, report = convert_to_domain_parallel(kinds_model()[:4], rules=all_kinds(), report=True)
    assert dict(report.converted) == {"0": "Conv2d -> DomainParallelConv2d",
                                      "1": "Blur -> DomainParallelBlur (halo of 1 row)",
                                      "3.conv": "Conv2d -> DomainParallelConv2d"}
    assert dict(report.local) == {"2": "Scale: scales each channel",
                                  "3": "Holder: its forward only chains its children",
                                  "3.act": "SiLU: pointwise activation"}
    assert type(model[1]) is DomainParallelBlur and type(model[3].conv) is DomainParallelConv2d
    assert len(set(world.allgather((message, str(report))))) == 1


def test_user_rules_come_after_allow_local_before_the_builtin_ones_first_match_first():
    keep = Rule("keep convs", nn.Conv2d, Decision.local("my convolutions see whole rows"))
    never = Rule("never", nn.Conv2d, Decision.refuse("not reached: an earlier rule matched"))
    model, report = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3), nn.GroupNorm(1, 2)),
                                               rules=[keep, never], report=True)
    assert type(model[0]) is nn.Conv2d and dict(report.local)["0"] == "Conv2d: my convolutions see whole rows"
    assert dict(report.converted) == {"1": "GroupNorm -> DomainParallelGroupNorm"}  # the built-in rule
    _, report = convert_to_domain_parallel(nn.Sequential(nn.Conv2d(2, 2, 3)), rules=[never], allow_local="0",
                                           report=True)
    assert dict(report.local) == {"0": "allow_local"}
    marker = nn.Identity()
    model, report = convert_to_domain_parallel(nn.Sequential(Scale()), rules=[Rule("scale", Scale, Decision.local(
        "scales")), ], custom_converters={Scale: lambda m: marker}, report=True)
    assert type(model[0]) is Scale  # rules before custom_converters
    model, report = convert_to_domain_parallel(nn.Sequential(Scale()), custom_converters={Scale: lambda m: marker},
                                               report=True)
    assert model[0] is marker and dict(report.converted) == {"0": "Scale -> Identity (custom_converters)"}


def test_a_predicate_rule_gets_the_path_shard_dim_and_manager():
    seen = []

    def by_path(module, context):
        seen.append(context)
        return context.name == "edge"

    rule = Rule("edge", by_path, Decision.local("the edge layer"))
    model = nn.ModuleDict({"edge": Mix(), "inner": nn.Sequential(nn.ReLU())})
    _, report = convert_to_domain_parallel(model, shard_dim=(-2, -1), rules=rule, report=True)
    assert dict(report.local)["edge"] == "Mix: the edge layer"
    assert all(isinstance(c, RuleContext) and c.shard_dim == (-2, -1) and c.manager is None for c in seen)
    assert [c.path for c in seen] == ["", "edge", "inner", "inner.0"]


def test_domain_parallel_module_is_the_base_of_every_layer_and_is_left_alone():
    layer = DomainParallelConv2d(nn.Conv2d(2, 2, 3, padding=1))
    assert isinstance(layer, DomainParallelModule)
    blur = nn.Sequential(Scale(), DomainParallelBlur(Blur(), -2, None))
    keys = list(blur.state_dict())
    model, report = convert_to_domain_parallel(blur, rules=[Rule("scale", Scale, Decision.local("scales"))],
                                               report=True)
    assert dict(report.local)["1"] == "DomainParallelBlur: domain-parallel already"
    assert list(model.state_dict()) == keys == ["0.scale"]
    wrapped = DomainParallelModule(Scale(), -2, None)
    assert list(wrapped.state_dict()) == ["scale"] and wrapped.wrapped is wrapped.module


def test_mistakes_name_the_argument_what_was_expected_and_the_fix():
    with pytest.raises(TypeError, match=r"Rule 'x': match must be a module type, a tuple of types or a callable"):
        Rule("x", 3, Decision.visit())
    with pytest.raises(TypeError, match=r"Rule 'x': action must be a Decision or a callable"):
        Rule("x", nn.ReLU, "local")
    with pytest.raises(TypeError, match=r"Rule name must be a non-empty str"):
        Rule("", nn.ReLU, Decision.visit())
    with pytest.raises(TypeError, match=r"Decision.local takes the reason as a non-empty str, got ''"):
        Decision.local("")
    with pytest.raises(TypeError, match=r"Decision.convert takes the replacement torch.nn.Module, got str"):
        Decision.convert("new")
    with pytest.raises(ValueError, match=r"Decision kind must be one of \('convert', 'local', 'refuse', 'visit'\)"):
        Decision("skip")
    bad = Rule("bad", nn.ReLU, lambda module, context: "local")
    with pytest.raises(TypeError, match=r"rule 'bad' returned str for 0 \(ReLU\), expected a Decision; return "
                                        r"Decision.convert\(new_module\)"):
        convert_to_domain_parallel(nn.Sequential(nn.ReLU()), rules=[bad])
    with pytest.raises(TypeError, match=r"rules must hold mpidomain.nn.Rule objects, got dict at index 0"):
        convert_to_domain_parallel(nn.ReLU(), rules=[{nn.ReLU: None}])
    with pytest.raises(TypeError, match=r"custom_converters\[ReLU\] returned str for 0, expected the "
                                        r"torch.nn.Module that replaces it"):
        convert_to_domain_parallel(nn.Sequential(nn.ReLU()), custom_converters={nn.ReLU: lambda m: "x"})
    with pytest.raises(TypeError, match="custom_converters keys must be module types"):
        convert_to_domain_parallel(nn.ReLU(), custom_converters={"ReLU": lambda m: m})


def test_a_model_converted_by_a_user_rule_equals_one_process(world):
    problems = []
    for D in divisors(world.size):
        with DomainParallelManager(world.size, D) as manager:
            torch.manual_seed(1)
            single = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), Blur(), Scale(3),
                                   nn.Conv2d(3, 2, 3, padding=1)).double()
            parallel = convert_to_domain_parallel(copy.deepcopy(single), manager,
                                                  rules=[blur_rule(), Rule("scale", Scale, Decision.local("scales"))])
            assert list(parallel.state_dict()) == list(single.state_dict())
            for rows in (4 * D, 4 * D + 3):
                problems += [f"D={D} rows={rows}: {p}" for p in
                             compare(manager, single, parallel, (2, 2, rows, 6), counts_for(rows, D))]
                single.zero_grad()
                parallel.zero_grad()
    assert not problems, "\n".join(problems)


def test_the_models_rules_convert_the_unet():
    model, report = convert_to_domain_parallel(UNet(), rules=RULES, report=True)
    assert dict(report.converted)["encode"] == "PeriodicConv -> DomainParallelPeriodicConv2d (mpidomain.models.RULES)"
    assert type(model.middle) is DomainParallelPeriodicConv2d


SAMPLES = [nn.Conv2d(2, 2, 3), nn.Conv2d(2, 2, 1), nn.Conv3d(2, 2, 3), nn.ConvTranspose2d(2, 2, 2, 2),
           nn.ConvTranspose2d(2, 2, 4, 2, 1), nn.Conv1d(2, 2, 1), nn.Conv1d(2, 2, 3), nn.ConvTranspose1d(2, 2, 2, 2),
           nn.ConvTranspose1d(2, 2, 3), nn.GroupNorm(1, 2), nn.BatchNorm2d(2), nn.Upsample(scale_factor=2),
           nn.MaxPool2d(2), nn.MaxPool2d(2, return_indices=True), nn.AdaptiveAvgPool2d(1), nn.PixelUnshuffle(2),
           nn.PixelShuffle(2), nn.ReLU(), nn.Identity(), nn.Dropout(), nn.Dropout2d(0), nn.Dropout2d(0.5),
           nn.Softmax(1), nn.Softmax(-2), nn.Softmax2d(), nn.Linear(2, 2), nn.LayerNorm(2), nn.LayerNorm((2, 2)),
           nn.Flatten(), nn.Embedding(2, 2), nn.ZeroPad2d((1, 1, 0, 0)), nn.ZeroPad2d(1), nn.GRU(2, 2),
           nn.Sequential(), Holder(), Mix(), DomainParallelConv2d(nn.Conv2d(2, 2, 3))]


def test_every_builtin_decision_is_one_its_table_rows_list():
    """The table cannot claim a decision a rule does not take: each sample's decision is among its rule's rows."""
    for module in SAMPLES:
        context = RuleContext("x", -2)
        rule = next(r for r in BUILTIN_RULES if r.matches(module, context))
        kinds = {kind for _, kind, _, _ in rule.table_rows()}
        assert rule.decide(module, context).kind in kinds, (module, rule.name)
    table = rules_table()
    assert table.count("\n") == 2 + sum(len(rule.table_rows()) for rule in table_rules())
    assert rules_table([Rule("mine", Scale, Decision.local("a | b"))]).splitlines()[2] == \
        "| 1 | `Scale` | local |  | a \\| b |"

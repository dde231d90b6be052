"""Where the settings of objectives, pruners and allocators are checked: each field's range in its annotation
(gpo/schema.py types, enforced when the config is composed), a rule between two fields in the config dataclass's
`__post_init__`; both reach the user as a one-line error that names the keys (CLI exit code 2)."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest

from gpo import cli, registry
from gpo.config import compose
from gpo.errors import UserError

registry.load_builtins()

# (picks and overrides, the whole message): the composer words each bound the same way for every component.
OUT_OF_RANGE = [
    (["algo=grpo", "algo.epsilon_low=-1"], "`algo.epsilon_low` must be >= 0.0, got -1. Valid: >= 0 and < 1."),
    (["algo=grpo", "algo.epsilon_low=1"], "`algo.epsilon_low` must be < 1.0, got 1. Valid: >= 0 and < 1."),
    (["algo=dapo", "algo.epsilon_high=-1"], "`algo.epsilon_high` must be >= 0.0, got -1."),
    (["algo=grpo", "algo.beta=-1"], "`algo.beta` must be >= 0.0, got -1."),
    (["algo=grpo", "algo.kl_clamp=0"], "`algo.kl_clamp` must be > 0.0, got 0."),
    (["algo=grpo", "algo.dual_clip=1"], "`algo.dual_clip` must be > 1.0, got 1."),
    (["correction=tis", "correction.cap=0.5"], "`correction.cap` must be >= 1.0, got 0.5."),
    (["algo=grpo", "algo.std_eps=-1"], "`algo.std_eps` must be >= 0.0, got -1."),
    (["algo=dapo", "algo.overlong_buffer=0"], "`algo.overlong_buffer` must be >= 1, got 0."),
    (["algo=dr_grpo", "algo.loss_normalizer=0"], "`algo.loss_normalizer` must be >= 1, got 0."),
    (["algo=cispo", "algo.epsilon_low=1"], "`algo.epsilon_low` must be < 1.0, got 1."),
    (["algo=gmpo", "algo.epsilon_low=-0.1"], "`algo.epsilon_low` must be >= 0.0, got -0.1."),  # log space
    (["algo=sapo", "algo.tau_neg=0"], "`algo.tau_neg` must be > 0.0, got 0."),
    (["algo=reinforce_pp", "algo.whiten_eps=0"], "`algo.whiten_eps` must be > 0.0, got 0."),
    (["pruner=topk", "pruner.keep=0"], "`pruner.keep` must be >= 1, got 0."),
    (["pruner=random", "pruner.rate=1"], "`pruner.rate` must be < 1.0, got 1."),
    (["pruner=threshold", "pruner.gamma=-1"], "`pruner.gamma` must be >= 0.0, got -1."),
    (["pruner=threshold", "pruner.min_keep_per_group=-1"], "`pruner.min_keep_per_group` must be >= 0, got -1."),
    (["allocator=dynamic", "allocator.rate=1"], "`allocator.rate` must be < 1.0, got 1."),
    (["allocator=static", "allocator.max_rounds=0"], "`allocator.max_rounds` must be >= 1, got 0."),
]

NEITHER_RATE_NOR_KEEP = ("set either `pruner.keep` (completions kept per group) or `pruner.rate` (the fraction "
                         "pruned, P); both are null.")


@pytest.mark.parametrize("overrides,message", OUT_OF_RANGE, ids=[" ".join(o) for o, _ in OUT_OF_RANGE])
def test_a_field_out_of_its_range_is_refused_when_composing(overrides, message):
    with pytest.raises(UserError) as err:
        compose(["tracker=none", *overrides])
    assert str(err.value) == message


@pytest.mark.parametrize("pruner", ["topk", "random"])
def test_a_rule_of_two_fields_is_refused_when_composing_and_names_both_keys(pruner):
    with pytest.raises(UserError) as err:
        compose(["tracker=none", f"pruner={pruner}", "pruner.rate=null"])  # keep is null by default
    assert str(err.value) == NEITHER_RATE_NOR_KEEP
    # Either field alone satisfies the rule: keep=3 replaces the rate, so 3 of a group of 8 are kept.
    cfg = compose(["tracker=none", f"pruner={pruner}", "pruner.rate=null", "pruner.keep=3"])
    assert (cfg.pruner.rate, cfg.pruner.keep) == (None, 3)
    assert registry.get("pruner", pruner).build(cfg.pruner.config).expected_kept_per_group(8) == 3.0


def test_the_rule_belongs_to_the_config_so_it_holds_without_the_composer():
    config = registry.get("pruner", "topk").config
    with pytest.raises(UserError, match="set either"):
        config(rate=None, keep=None)
    assert config(rate=None, keep=2).keep == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["algo=dapo", "algo.epsilon_high=-1"], "`algo.epsilon_high` must be >= 0.0, got -1."),
        (["algo=grpo", "algo.epsilon_low=-1"], "`algo.epsilon_low` must be >= 0.0, got -1."),
        (["pruner=topk", "pruner.rate=null"], NEITHER_RATE_NOR_KEEP),
    ],
)
def test_dry_run_reports_them_in_one_line_with_exit_code_2(overrides, message, capsys):
    assert cli.main(["run", "--dry-run", "tracker=none", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err, err


def _numeric_fields_without_a_bound(config: type) -> list[str]:
    """Fields typed int or float (optionally `| None`) whose annotation carries no annotated_types bound."""
    hints = typing.get_type_hints(config, include_extras=True)
    missing = []
    for field in dataclasses.fields(config):
        hint = hints[field.name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = [a for a in typing.get_args(hint) if a is not type(None)] if is_union else [hint]
        for option in options:
            base = typing.get_args(option)[0] if typing.get_origin(option) is typing.Annotated else option
            bounds = [m for m in getattr(option, "__metadata__", ()) if type(m).__module__ == "annotated_types"]
            if base in (int, float) and not bounds:
                missing.append(field.name)
    return missing


@pytest.mark.parametrize("kind", ["algo", "pruner", "allocator"])
def test_every_numeric_setting_of_a_builtin_component_has_its_range_in_its_annotation(kind):
    """The annotation is the one place a field's range is stated, so a numeric field without one is unchecked."""
    builtin = [e for e in registry.entries(kind) if e.cls.__module__.startswith("gpo.")]
    assert builtin
    for entry in builtin:
        assert _numeric_fields_without_a_bound(entry.config) == [], (kind, entry.name)

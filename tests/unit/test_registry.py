"""The registry: decorator registration, typed configs, duplicate and unknown names, plug-in loading."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
import torch

from gpo import registry
from gpo.errors import UserError, did_you_mean
from gpo.registry import register
from kit import fresh_registry, make_plugin  # noqa: F401  (fresh_registry is a fixture)

pytestmark = pytest.mark.usefixtures("fresh_registry")


@dataclass
class RateConfig:
    rate: float = 0.5
    scopes: list[str] = field(default_factory=lambda: ["group"])


def _pruner(name: str, config: type = RateConfig) -> type:
    """A fresh class each call, so two calls are two different components."""

    class Dummy:
        """Keep nothing.

        A second paragraph that `gpo list` does not show.
        """

        def __init__(self, cfg, **context):
            self.cfg, self.context = cfg, context

        def keep(self, batch, multiple_of=1):
            return None

        def expected_kept_per_group(self, group_size):
            return None

    Dummy.__qualname__ = f"Dummy_{name}"
    return register("pruner", name, config=config)(Dummy)


def test_register_then_get_returns_the_class_and_its_config():
    cls = _pruner("topk")
    entry = registry.get("pruner", "topk")
    assert (entry.kind, entry.name, entry.cls, entry.config) == ("pruner", "topk", cls, RateConfig)
    assert cls.registry_name == "topk"
    assert registry.names("pruner") == ["topk"]
    assert registry.names("algo") == []


def test_names_and_entries_are_sorted():
    for name in ("zeta", "alpha", "mid"):
        _pruner(name)
    assert registry.names("pruner") == ["alpha", "mid", "zeta"]
    assert [e.name for e in registry.entries("pruner")] == ["alpha", "mid", "zeta"]


def test_summary_is_the_docstring_first_line_and_defaults_call_factories():
    entry = registry.get("pruner", _pruner("topk").registry_name)
    assert entry.summary == "Keep nothing."
    assert entry.defaults() == {"rate": 0.5, "scopes": ["group"]}


def test_build_accepts_none_a_mapping_or_the_dataclass_and_passes_context():
    entry = registry.get("pruner", _pruner("topk").registry_name)
    assert entry.build().cfg == RateConfig()
    built = entry.build({"rate": 0.875}, world_size=2)
    assert built.cfg == RateConfig(rate=0.875) and built.context == {"world_size": 2}
    cfg = RateConfig(rate=0.25)
    assert entry.build(cfg).cfg is cfg


def test_build_names_what_a_component_lacks_of_its_interface():
    @register("task", "old_task", config=RateConfig)
    class OldTask:  # written before close() joined the Task interface
        def __init__(self, cfg):
            pass

        def load(self, split):
            return []

        def prompt(self, example):
            return []

        def reward(self, completions, examples):
            return None

        def grade(self, completions, examples):
            return []

    with pytest.raises(UserError, match=r"task `old_task` \(.*OldTask\) lacks `close\(\)` of the Task interface"):
        registry.get("task", "old_task").build()


def test_build_with_an_unknown_key_names_it_and_the_closest():
    entry = registry.get("pruner", _pruner("topk").registry_name)
    with pytest.raises(UserError, match=r"`pruner.rat`.*Did you mean `pruner.rate`\?"):
        entry.build({"rat": 0.5})


def test_a_duplicate_name_from_another_class_raises_naming_both():
    _pruner("topk")
    with pytest.raises(UserError, match=r"pruner 'topk' is already registered by .*Dummy_topk; .*Other cannot"):

        @register("pruner", "topk", config=RateConfig)
        class Other:
            pass


def test_the_same_class_registering_twice_is_not_a_duplicate():
    # A module imported twice (once as a plug-in path, once through gpo) re-runs its decorators.
    cls = _pruner("topk")
    register("pruner", "topk", config=RateConfig)(cls)
    assert registry.names("pruner") == ["topk"]


def test_the_same_name_in_two_kinds_is_fine():
    _pruner("static")
    register("allocator", "static", config=RateConfig)(type("Alloc", (), {}))
    assert registry.names("pruner") == registry.names("allocator") == ["static"]


def test_register_rejects_an_unknown_kind_and_a_config_that_is_not_a_dataclass():
    with pytest.raises(ValueError, match="unknown component kind 'prunner'"):
        register("prunner", "x", config=RateConfig)
    with pytest.raises(TypeError, match="config must be a dataclass"):
        register("pruner", "x", config=dict)


def test_an_unknown_name_lists_the_valid_ones_and_suggests_the_closest():
    for name in ("topk", "threshold", "none"):
        _pruner(name)
    with pytest.raises(UserError) as err:
        registry.get("pruner", "topp")
    assert str(err.value) == "unknown pruner `topp`. Valid choices: none, threshold, topk. Did you mean `topk`?"


def test_an_unknown_name_with_nothing_close_has_no_suggestion():
    _pruner("topk")
    with pytest.raises(UserError) as err:
        registry.get("pruner", "zzzzzz")
    assert str(err.value) == "unknown pruner `zzzzzz`. Valid choices: topk."


def test_an_unknown_name_in_an_empty_kind_says_so():
    with pytest.raises(UserError, match=r"unknown algo `grpo`\. Valid choices: \(none registered\)\."):
        registry.get("algo", "grpo")


def test_an_unknown_kind_lists_the_kinds():
    kinds = "algo, selector, pruner, allocator, task, backend, correction, tracker"
    with pytest.raises(UserError, match=f"kinds are {kinds}"):
        registry.get("prunner", "topk")


def test_did_you_mean_uses_a_similarity_cutoff():
    # difflib ratio("lrr", "lr") = 2*2/(3+2) = 0.8 >= 0.6; ratio("lrr", "eps") = 0.
    assert did_you_mean("lrr", ["eps", "lr"]) == " Did you mean `lr`?"
    assert did_you_mean("lrr", ["eps"]) == ""


# --- plug-ins ----------------------------------------------------------------------------------------------------


def _batch(n: int):
    """Only len(batch) matters to the test plug-in."""
    return torch.zeros(n, 1)


def test_a_plugins_module_registers_its_components(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(make_plugin(tmp_path, "gpo_test_mod_plugin", "every_other", entry_point=False)))
    registry.load_plugins(["gpo_test_mod_plugin"])
    pruner = registry.get("pruner", "every_other").build({"offset": 1})
    # offset 1: rows 0..3 -> (0+1)%2, (1+1)%2, ... = 1, 0, 1, 0 -> keep rows 1 and 3
    assert pruner.keep(_batch(4)).tolist() == [False, True, False, True]


def test_an_entry_point_in_the_gpo_plugins_group_is_loaded(tmp_path, monkeypatch):
    # A real installed-distribution record on sys.path: importlib.metadata finds it like one pip wrote.
    monkeypatch.syspath_prepend(str(make_plugin(tmp_path, "gpo_test_ep_plugin", "every_second")))
    registry.load_plugins()
    assert "every_second" in registry.names("pruner")
    assert "gpo_test_ep_plugin" in sys.modules


def test_a_missing_plugins_module_is_a_user_error():
    with pytest.raises(UserError, match=r"plugins: cannot import module `no_such_gpo_plugin`"):
        registry.load_plugins(["no_such_gpo_plugin"])


def test_a_plugins_module_that_fails_on_import_is_a_user_error(tmp_path, monkeypatch):
    (tmp_path / "gpo_test_broken.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"importing module `gpo_test_broken` failed: RuntimeError\('boom'\)"):
        registry.load_plugins(["gpo_test_broken"])


def test_a_broken_entry_point_is_a_user_error_naming_it(tmp_path, monkeypatch):
    dist = tmp_path / "broken_dist-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_dist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gpo.plugins]\nbroken = gpo_no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"entry point `broken = gpo_no_such_module_xyz` failed to load"):
        registry.load_plugins()

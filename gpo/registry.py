"""One registry per kind of component, filled by the `@register(kind, name)` decorator.

Every entry carries a typed config dataclass whose defaults are the paper's settings; the config composer
validates a user's YAML against it before anything heavy is imported. Built-in components register when
their package is imported (`load_builtins`); out-of-tree ones through the entry-point group `gpo.plugins`
or a `plugins: [module, ...]` config key (`load_plugins`), so nobody has to fork gpo to add a part.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from gpo.errors import UserError, did_you_mean
from gpo.run_config import KINDS
from gpo.schema import field_default, validated

# Importing these registers every built-in component of gpo.
BUILTIN_MODULES = (
    "gpo.algorithms",
    "gpo.selectors",
    "gpo.pruners",
    "gpo.allocators",
    "gpo.tasks",
    "gpo.backends",
    "gpo.corrections",
    "gpo.tracking",
)
PLUGIN_GROUP = "gpo.plugins"


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    cls: type
    config: type  # a dataclass; its defaults are the component's documented defaults

    @property
    def summary(self) -> str:
        """First line of the component's docstring (shown by `gpo list`)."""
        doc = inspect.getdoc(self.cls) or ""
        return doc.splitlines()[0] if doc else ""

    def defaults(self) -> dict[str, Any]:
        return {f.name: field_default(f) for f in dataclasses.fields(self.config)}

    def build(self, cfg: Any = None, **context: Any) -> Any:
        """Instantiate the component with `cfg` (a config dataclass, a mapping, or None for defaults). A mapping is
        checked as the composer checks a config section: unknown keys, types, choices and ranges."""
        if cfg is None:
            cfg = self.config()
        elif not isinstance(cfg, self.config):
            cfg = validated(dict(cfg), self.config, self.kind)
        built = self.cls(cfg, **context)
        missing = missing_members(self.kind, built)
        if missing:  # a plug-in written against an older interface: say so before it fails mid-run
            raise UserError(f"{self.kind} `{self.name}` ({_qualified(self.cls)}) lacks {', '.join(missing)} of the "
                            f"{INTERFACES[self.kind]} interface (gpo/types.py); "
                            f"add {'it' if len(missing) == 1 else 'them'}.")
        return built


_entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
# The Protocol class of gpo/types.py that each kind implements (a key for every kind, in KINDS' order).
INTERFACES = dict(zip(KINDS, ("Objective", "Selector", "Pruner", "Allocator", "Task", "Backend", "Correction",
                             "Tracker"), strict=True))


def missing_members(kind: str, component: Any) -> list[str]:
    """The methods and attributes of the kind's interface that `component` does not have."""
    from gpo import types

    protocol = getattr(types, INTERFACES[kind])
    wanted = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    wanted += [n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_")]
    return [f"`{n}" + ("()`" if callable(getattr(protocol, n, None)) else "`") for n in wanted
            if not hasattr(component, n)]


def register(kind: str, name: str, config: type) -> Callable[[type[Any]], type[Any]]:
    """Class decorator: `@register("pruner", "topk", config=TopKConfig)`."""
    if kind not in _entries:
        raise ValueError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")
    if not dataclasses.is_dataclass(config):
        raise TypeError(f"{kind} {name!r}: config must be a dataclass, got {config!r}")

    def decorator(cls: type[Any]) -> type[Any]:  # type[Any]: the registry gives any class its registry_name
        existing = _entries[kind].get(name)
        # The same class registering again (a module imported twice, e.g. through a plug-in path) is harmless.
        if existing is not None and _qualified(existing.cls) != _qualified(cls):
            raise UserError(
                f"{kind} {name!r} is already registered by {_qualified(existing.cls)}; "
                f"{_qualified(cls)} cannot take the same name"
            )
        _entries[kind][name] = Entry(kind, name, cls, config)
        cls.registry_name = name
        return cls

    return decorator


def get(kind: str, name: str) -> Entry:
    """The entry for `name`, or a UserError listing the valid names and the closest one."""
    if kind not in _entries:
        raise UserError(f"unknown component kind `{kind}`; kinds are {', '.join(KINDS)}.")
    try:
        return _entries[kind][name]
    except KeyError:
        valid = sorted(_entries[kind])
        raise UserError(
            f"unknown {kind} `{name}`. Valid choices: {', '.join(valid) or '(none registered)'}."
            + did_you_mean(str(name), valid)
        ) from None


def build(component: Any, **context: Any) -> Any:
    """Instantiate a picked component of the run config (`cfg.pruner`: its kind, name and validated config)."""
    return get(component.kind, component.name).build(component.config, **context)


def names(kind: str) -> list[str]:
    return sorted(_entries[kind])


def entries(kind: str) -> list[Entry]:
    return [_entries[kind][n] for n in names(kind)]


def load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


def load_plugins(modules: Iterable[str] = ()) -> None:
    """Import every `gpo.plugins` entry point and every module named in the config's `plugins` list."""
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()
        except UserError:
            raise  # e.g. a duplicate name: its message already says what is wrong
        except Exception as exc:  # a broken plug-in must not hide the cause, nor look like a bug in gpo
            raise UserError(f"plug-in entry point `{ep.name} = {ep.value}` failed to load: {exc!r}") from exc
    for module in modules:
        try:
            importlib.import_module(module)
        except UserError:
            raise
        except ImportError as exc:
            raise UserError(f"plugins: cannot import module `{module}`: {exc}") from exc
        except Exception as exc:
            raise UserError(f"plugins: importing module `{module}` failed: {exc!r}") from exc


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"

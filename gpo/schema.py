"""Field types for config dataclasses, and the validation that checks a mapping against them before anything loads.

A config field says what it accepts in its annotation, and the composer enforces it with the same messages for
every section and every component (plug-ins included):

    loss_agg: Literal["seq_mean", "token_mean"] = "seq_mean"   # a choice: a typo gets a did-you-mean
    beta: NonNegative = 0.04                                   # a range: -0.1 is refused with the bound
    rate: Rate = 0.5                                           # 0 <= rate < 1
    steps: Annotated[int, Ge(1)] = 12                          # any annotated_types bound works

Config dataclasses are frozen (`@dataclass(frozen=True)`), with tuples for sequences, so a validated run config
cannot be changed behind the composer's back.

Other names of a choice's values go in the annotation too, and are replaced by the value itself when validated, so
only that value travels on (`model.dtype=bf16` arrives as `bfloat16`, `backend.precision=bfloat16` as `bf16`):

    precision: Annotated[Literal["auto", "float32", "bf16"], PRECISION_NAMES] = "auto"

A component's config class may say two more things (plain sections have no need: gpo.config checks those):

    MOVED_KEYS: ClassVar[Mapping[str, str]] = {"old_key": "what says the same thing now"}   # refused, with that

    def check_run(self, run: RunConfig) -> None:   # gpo.run_config.RunConfig
        # Rules that involve another section: raise a UserError naming the keys, e.g. `selector.n_screen=8 is
        # not smaller than train.group_size=8`; return None when the run is fine.

The composer calls `check_run` on every component's config once the whole run config is valid (each field in its
range, every section built), so a plug-in adds such a rule without touching gpo; `gpo run --dry-run` reports it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, Lt
from pydantic import AfterValidator

from gpo.errors import UserError, did_you_mean

PositiveInt = Annotated[int, Ge(1)]
NonNegativeInt = Annotated[int, Ge(0)]
Positive = Annotated[float, Gt(0)]
NonNegative = Annotated[float, Ge(0)]
Rate = Annotated[float, Ge(0), Lt(1)]  # a fraction that leaves something: pruning rates, drop rates
Fraction = Annotated[float, Ge(0), Le(1)]  # a probability or share, both ends allowed


def _existing_dir(value: str) -> str:
    if not Path(value).expanduser().is_dir():
        what = "is a file, not a directory" if Path(value).expanduser().exists() else "does not exist"
        raise ValueError(f"`{value}` {what}. Point it at an existing local directory (relative paths are read "
                         "from the directory gpo runs in), or leave it unset.")
    return value


# A local directory that must exist when the config is composed (a task's data_dir), kept as the text given:
# a typo fails `--dry-run` instead of the first read, after the model has loaded.
ExistingDir = Annotated[str, AfterValidator(_existing_dir)]



@dataclasses.dataclass(frozen=True)
class Aliases:
    """Annotated metadata of a choice (a `Literal`): other names users type for its values. Each group is one
    value's names; a name of a group becomes the group's member that is among the field's choices."""

    groups: tuple[tuple[str, ...], ...]

    def canonical(self, value: Any, choices: Iterable[Any]) -> Any:
        """`value` as the field's own name for it; `value` itself when it is a choice or no group holds it."""
        options = list(choices)
        if value in options or not isinstance(value, str):
            return value
        for group in self.groups:
            if value in group:
                return next((name for name in group if name in options), value)
        return value


# A precision as torch users write it (torch.bfloat16, "half", ...) and as gpo's short names do.
PRECISION_NAMES = Aliases((("bf16", "bfloat16"), ("fp16", "float16", "half"), ("float32", "fp32")))
# A mixed precision: `no` computes in float32.
MIXED_PRECISION_NAMES = Aliases((("bf16", "bfloat16"), ("fp16", "float16", "half"), ("no", "float32", "fp32")))
RUN_CHECK = "check_run"  # the method of a component's config that checks it against the whole run (docstring)
MOVED = "MOVED_KEYS"  # a config class's keys that left it, and what says the same thing now (docstring)

__all__ = ["MIXED_PRECISION_NAMES", "PRECISION_NAMES", "RUN_CHECK", "Aliases", "ExistingDir", "Fraction", "Ge", "Gt",
           "Le", "Lt", "NonNegative", "NonNegativeInt", "Positive", "PositiveInt", "Rate", "field_default",
           "validated"]


# --- validation: a mapping against a config dataclass, with messages about the user's keys --------------------


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default value (a fresh one from its factory), or "???" when it has none."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "???"


def validated(node: Mapping[str, Any], schema: type, path: str) -> Any:
    """`node` as an instance of the dataclass `schema`: unknown keys, wrong types, choices and ranges are
    UserErrors with the full key path (`path` is the section's own, e.g. "train" or "pruner")."""
    node = _plain(node)
    _check_keys(node, schema, path)
    node = _over_defaults(_aliases_as_choices(_numbers_as_text(node, schema), schema), schema)
    from pydantic import ValidationError

    try:
        adapter = _adapter(schema)
    except Exception:  # a plug-in annotation pydantic cannot read: the dataclass's own constructor decides
        try:
            return schema(**node)
        except TypeError as exc:
            raise UserError(f"`{path}`: {exc}.") from None
    try:
        return adapter.validate_python(node)
    except ValidationError as exc:
        raise UserError(_explain(exc.errors()[0], schema, path)) from None


@functools.cache
def _adapter(schema: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(schema)


def _explain(error: Mapping[str, Any], schema: type, path: str) -> str:
    """One pydantic error as a sentence about the user's key."""
    loc = [str(p) for p in error["loc"]]
    key = _join(path, ".".join(loc))
    value = error.get("input")
    kind, ctx = error["type"], error.get("ctx") or {}
    options = _choices_at(schema, loc)
    if options is not None and kind in ("literal_error", "enum"):
        shown = [str(o) for o in options]
        return (f"`{key}` must be one of {', '.join(shown)}; got `{value}`." + did_you_mean(str(value), shown))
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        bound = next(iter(ctx.values()))
        return f"`{key}` must be {bounds[kind]} {bound}, got {value!r}." + _range_hint(schema, loc)
    if kind == "missing":
        return f"`{key}` is required and has no default: set it (`{key}=...`)."
    if kind == "value_error":  # a field's own validator (e.g. a directory that must exist) says what is wrong
        return f"`{key}`: {str(ctx.get('error') or error['msg']).removeprefix('Value error, ')}"
    expected = _type_name(schema, loc)
    hint = ""
    if isinstance(value, Mapping) and len(value) == 1 and next(iter(value.values())) is None and "str" in expected:
        # YAML reads an unquoted `{q}` as a mapping {q: null}: a template placeholder that lost its quotes
        name = next(iter(value))
        hint = f" In a YAML file, quote a template: `{loc[-1]}: \"{{{name}}}\"`."
    return f"`{key}` has the wrong type: expected {expected}, got {value!r}." + hint


def _range_hint(schema: type, loc: list[str]) -> str:
    hint = _hint_at(schema, loc)
    bounds = [m for m in getattr(hint, "__metadata__", ()) if type(m).__module__.startswith("annotated_types")]
    if len(bounds) < 2:
        return ""
    text = {"Ge": ">=", "Gt": ">", "Le": "<=", "Lt": "<"}
    # annotated_types bounds are slotted dataclasses (no __dict__): read their one field by name
    parts = [f"{text.get(type(b).__name__, type(b).__name__)} {getattr(b, dataclasses.fields(b)[0].name)}"
             for b in bounds]
    return f" Valid: {' and '.join(parts)}."


def _hint_at(schema: Any, loc: list[str]) -> Any:
    """The annotation at a pydantic error location: field names in dataclasses, indices in tuples."""
    hint = schema
    for part in loc:
        core = _core(hint)
        if part.isdigit() and typing.get_origin(core) in (tuple, list):
            args = [a for a in typing.get_args(core) if a is not Ellipsis]
            hint = args[0] if len(args) == 1 else (args[int(part)] if int(part) < len(args) else None)
        elif isinstance(core, type) and dataclasses.is_dataclass(core):
            hint = _hints(core).get(part)
        else:
            return None
    return hint


def _core(hint: Any) -> Any:
    """Annotated[X, ...] -> X; X | None -> X (the type a value of the field has when it is set)."""
    options = [h for h in _flatten_hint(hint) if h is not type(None)]
    return options[0] if len(options) == 1 else hint


def _choices_at(schema: type, loc: list[str]) -> list[Any] | None:
    hint = _hint_at(schema, loc)
    for arg in _flatten_hint(hint):
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
        if isinstance(arg, type) and issubclass(arg, enum.Enum):
            return [m.value for m in arg]
    return None


def _type_name(schema: type, loc: list[str]) -> str:
    hint = _hint_at(schema, loc)
    if hint is None:
        return "a valid value"
    return " | ".join(_type_text(h) for h in _flatten_hint(hint))


def _type_text(hint: Any) -> str:
    """How a user writes the type in YAML: sequences are lists (tuple[float, ...] and tuple[float, float] are
    `list[float]`), bounds are left to the range message."""
    if hint is type(None):
        return "None"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (tuple, list):
        items = sorted({" | ".join(_type_text(h) for h in _flatten_hint(a)) for a in args if a is not Ellipsis})
        return f"list[{' | '.join(items)}]" if items else "list"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    return getattr(hint, "__name__", str(hint))


def _flatten_hint(hint: Any) -> list[Any]:
    """Annotated[X, ...] -> [X]; X | None -> [X, NoneType]; anything else -> [hint]."""
    if typing.get_origin(hint) is typing.Annotated:
        return _flatten_hint(typing.get_args(hint)[0])
    if typing.get_origin(hint) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [h for arg in typing.get_args(hint) for h in _flatten_hint(arg)]
    return [hint]


@functools.cache
def _hints(schema: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(schema, include_extras=True)
    except Exception:  # an annotation that cannot be resolved: fall back to the fields' own (string) types
        return {f.name: f.type for f in dataclasses.fields(schema)}


def _numbers_as_text(node: Mapping[str, Any], schema: type) -> dict[str, Any]:
    """`run_name=2024` or `eval.split=1` parse as numbers on the command line; a text field takes them as text, and
    a choice of words takes back `no` (`engine.mixed_precision=no`), which YAML parses as false."""
    out = dict(node)
    for key, value in node.items():
        if isinstance(value, bool):  # YAML reads `no`/`yes` as booleans; a choice of those words takes them back
            words = [c for h in _flatten_hint(_hints(schema).get(key)) if typing.get_origin(h) is typing.Literal
                     for c in typing.get_args(h)]
            word = "yes" if value else "no"
            if word in words and value not in words:
                out[key] = word
        elif isinstance(value, (int, float)):
            options = _flatten_hint(_hints(schema).get(key))
            if str in options and not ({int, float} & set(options)):
                out[key] = str(value)
    return out


def _aliases_as_choices(node: dict[str, Any], schema: type) -> dict[str, Any]:
    """Another name of a choice's value (`bfloat16` for `bf16`, the field's `Aliases`) as the value itself."""
    out = dict(node)
    for key, value in node.items():
        hint = _hints(schema).get(key)
        for alias in getattr(hint, "__metadata__", ()):
            if isinstance(alias, Aliases):
                out[key] = alias.canonical(value, _choices_at(schema, [key]) or ())
    return out


def _over_defaults(node: dict[str, Any], schema: type) -> dict[str, Any]:
    """A nested section given in part (`task.train.path=...`) keeps the field's other defaults: the mapping is laid
    over the field's default dataclass, as a YAML layer would be."""
    out = dict(node)
    for f in dataclasses.fields(schema):
        value = node.get(f.name)
        default = field_default(f)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(default) and not isinstance(default, type):
            out[f.name] = {**_as_plain(default), **_over_defaults(dict(value), type(default))}
    return out


def _check_keys(node: Any, schema: type, path: str) -> None:
    if not isinstance(node, Mapping):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    moved: Mapping[str, str] = getattr(schema, MOVED, None) or {}
    for key in node:
        full = _join(path, str(key))
        if key in moved and key not in fields:
            raise UserError(f"`{full}` is no longer a setting: {moved[key]}.")
        if key not in fields:
            valid = [_join(path, f) for f in fields]
            raise UserError(f"unknown key `{full}`." + did_you_mean(full, valid) + valid_keys_hint(valid))
        sub = _dataclass_of(fields[key])
        if sub is not None and node[key] is not None:
            if not isinstance(node[key], Mapping):
                raise UserError(not_a_section(full, node[key], sub))
            _check_keys(node[key], sub, full)


def not_a_section(full: str, value: Any, schema: type) -> str:
    sub_keys = [_join(full, f.name) for f in dataclasses.fields(schema)]
    return (f"`{full}` is a section, not a value (got {value!r}); set its keys instead, e.g. `{sub_keys[0]}=...`."
            + valid_keys_hint(sub_keys))


def _dataclass_of(f: dataclasses.Field) -> type | None:
    default = field_default(f)
    return type(default) if dataclasses.is_dataclass(default) and not isinstance(default, type) else None


def valid_keys_hint(valid: Any) -> str:
    return f" Valid keys: {', '.join(sorted(valid))}."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain containers (the composer's layers are OmegaConf; everything else passes)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value


def _as_plain(value: Any) -> Any:
    """A nested section's default dataclass as a mapping (enums as values, tuples as lists), as YAML would give it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_as_plain(v) for v in value]
    return value


def valid_run_name(value: str) -> str:
    """A run's directory name under output_dir: one path component, so the run cannot land outside output_dir."""
    if value in ("", ".", ".."):
        raise ValueError(f"`{value}` is not a directory name: give a plain name such as `cppo-arith-1`.")
    separators = [s for s in ("/", "\\", "\0") if s in value]
    if separators:
        raise ValueError(f"`{value}` contains `{separators[0]!r}`: a run name is one directory inside output_dir, "
                         "so it may not hold path separators; set the parent folder with output_dir instead.")
    return value


# `run_name`: the directory the run writes under output_dir.
RunName = Annotated[str, AfterValidator(valid_run_name)]

# What MLflow's tracking store registry reads (mlflow.tracking._tracking_service.utils): "" (a path) and file are
# directory stores; the database engines also take a driver (`postgresql+psycopg2://...`).
URI_SCHEMES = ("http", "https", "file", "databricks", "databricks-uc", "uc", "sqlite", "postgresql", "mysql",
               "mssql")
_NEEDS_HOST = ("http", "https", "postgresql", "mysql", "mssql")


def valid_tracking_uri(value: str) -> str:
    """An MLflow tracking URI: a known scheme with what that scheme needs (a host, a database path), or a plain
    path. A scheme added by an installed MLflow plug-in (entry points `mlflow.tracking_store`) is taken as is."""
    from importlib.metadata import entry_points
    from urllib.parse import urlsplit

    examples = "e.g. http://127.0.0.1:5000, sqlite:///runs/mlflow.db or databricks"
    if not value.strip():
        raise ValueError(f"an empty tracking URI: leave it unset for the run's own store, or give one ({examples}).")
    if value in ("databricks", "databricks-uc", "uc"):  # MLflow reads these bare names as URIs of that scheme
        return value
    try:
        parts = urlsplit(value)
        host = parts.hostname
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket or a port that is not a number
        raise ValueError(f"`{value}` is not a valid URI ({exc}); {examples}.") from None
    scheme = parts.scheme.lower()
    base = scheme.partition("+")[0]
    if not scheme or (len(scheme) == 1 and scheme.isalpha()):  # MLflow reads `C:\\...` as a path too
        first = value.split("/", 1)[0].rstrip(":").lower()
        if first in URI_SCHEMES or parts.netloc:  # `http//host`, `//host`: a URI missing its `scheme:`
            raise ValueError(f"`{value}` looks like a URI without its `scheme://` ({examples}); a plain path would "
                             "be a directory store.")
        return value
    if base not in URI_SCHEMES and scheme not in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        raise ValueError(f"`{value}` has the unknown scheme `{parts.scheme}`; MLflow reads "
                         f"{', '.join(URI_SCHEMES)} or a plain path ({examples}).")
    if base in _NEEDS_HOST and not host:
        raise ValueError(f"`{value}` has no host: write {base}://HOST[:PORT]/... ({examples}).")
    if base == "sqlite" and not (value.startswith(f"{parts.scheme}:///") and len(value) > len(parts.scheme) + 4):
        raise ValueError(f"`{value}` is not an SQLite URI: write sqlite:///relative/path.db or "
                         "sqlite:////absolute/path.db.")
    if base == "file" and not parts.path:
        raise ValueError(f"`{value}` names no directory: write file:///absolute/path ({examples}).")
    return value


# `tracker.uri` of the mlflow tracker.
TrackingUri = Annotated[str, AfterValidator(valid_tracking_uri)]

__all__ += ["RunName", "TrackingUri", "URI_SCHEMES", "valid_run_name", "valid_tracking_uri"]

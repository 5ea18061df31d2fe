"""TOML files and dotted CLI overrides -> a validated JobConfig. Precedence: CLI > TOML > defaults.

Every user mistake raises ``ConfigError`` (a ValueError) with one line naming the key, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from meshforge.config.schema import JobConfig
from meshforge.errors import ConfigError as ConfigError  # re-exported: the name every room imports from here
from meshforge.errors import optional_import

TOMLI_W_INSTALL = "pip install tomli_w"

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def field_types(cls: Any) -> dict[str, Any]:
    """Resolved type hints of a config dataclass."""
    return typing.get_type_hints(cls)


def load_config(path: str | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Defaults, then the TOML file, then the dotted CLI overrides; validated."""
    tree: dict[str, Any] = {}
    if path:
        tree = read_toml(path)
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    cfg = build(JobConfig, tree, prefix="")
    cfg.validate()  # raises ConfigError (a ValueError from anywhere else is a bug and keeps its traceback)
    return cfg


def read_toml(path: str) -> dict[str, Any]:
    tree: dict[str, Any] = read_data(path, "--config", hint=" (configs/ holds the shipped ones)")
    return tree


def read_data(path: str | Path, flag: str, *, fmt: str = "toml", hint: str = "") -> Any:
    """The TOML (``fmt = "toml"``) or JSON (``"json"``) file at ``path``, parsed; a missing or unparsable file is a
    one-line ConfigError naming the option it came from: '``flag`` PATH: no such file``hint``' or '... not valid TOML
    (the parser's reason)'. The one place the commands turn file and format errors into messages."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"{flag} {path}: no such file{hint}")
    try:
        return tomllib.loads(file.read_text()) if fmt == "toml" else json.loads(file.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: not valid {fmt.upper()} ({exc})") from None


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """``--a.b value``, ``--a.b=value``, a bare ``--a.b`` switch (true for booleans) -> [(dotted key, typed value)]."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key value")
        key, eq, raw = arg[2:].partition("=")
        typ = type_of(key)
        if eq:
            i += 1
        elif _switch(typ):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in _TRUE | _FALSE:
                raw, i = nxt, i + 2
            elif nxt is not None and typ is not bool and not nxt.startswith("--"):
                raw, i = nxt, i + 2  # a switch that also takes a word (bool | Literal["auto"])
            elif nxt is not None and not nxt.startswith("--"):
                raise ConfigError(f"{key} = {nxt!r} is not a boolean (use true or false, or the bare switch)")
            else:
                raw, i = "true", i + 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            raw, i = argv[i + 1], i + 2
        pairs.append((key, coerce(key, raw, typ)))
    return pairs


def type_of(dotted: str) -> Any:
    """The declared type of a dotted key; ConfigError naming the valid keys of the section otherwise."""
    cls: Any = JobConfig
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        hints = field_types(cls)
        if part not in hints:
            where = ".".join(parts[:depth]) or "the top level"
            raise ConfigError(f"unknown config key {dotted!r}: {where} has {', '.join(sorted(hints))}")
        typ = hints[part]
        if depth == len(parts) - 1:
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{dotted!r} is a section, not a key: it has {', '.join(sorted(field_types(typ)))}")
            return typ
        if not dataclasses.is_dataclass(typ):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(parts[: depth + 1])} is not a section")
        cls = typ
    raise AssertionError("unreachable")


def _switch(typ: Any) -> bool:
    """A boolean, or a union with one (``bool | Literal["auto"]``): a bare ``--key`` means true."""
    return typ is bool or (get_origin(typ) in (types.UnionType, typing.Union) and bool in get_args(typ))


def coerce(key: str, raw: str, typ: Any) -> Any:
    """A CLI string to the field's type."""
    if typ is not bool and _switch(typ):
        return raw.lower() in _TRUE if raw.lower() in _TRUE | _FALSE else raw
    if typ is bool:
        if raw.lower() in _TRUE | _FALSE:
            return raw.lower() in _TRUE
        raise ConfigError(f"{key} = {raw!r} is not a boolean (use true or false)")
    if typ in (int, float):
        try:
            return typ(raw)
        except ValueError:
            raise ConfigError(f"{key} = {raw!r} is not {'an integer' if typ is int else 'a number'}") from None
    if get_origin(typ) is list:
        try:
            value = tomllib.loads(f"v = {raw}")["v"] if raw.startswith("[") else [s for s in raw.split(",") if s]
        except tomllib.TOMLDecodeError:
            raise ConfigError(f"{key} = {raw!r} is not a list (use a,b or a TOML list)") from None
        return value
    return raw


def build(cls: type, tree: dict[str, Any], prefix: str) -> Any:
    """A dataclass from a nested dict, rejecting unknown keys and wrong types."""
    hints = field_types(cls)
    if not isinstance(tree, dict):
        raise ConfigError(f"[{prefix.rstrip('.')}] must be a table of keys")
    unknown = sorted(set(tree) - set(hints))
    if unknown:
        where = f"section [{prefix.rstrip('.')}]" if prefix else "the top level"
        raise ConfigError(f"unknown config key {prefix + unknown[0]!r}: {where} has {', '.join(sorted(hints))}")
    kwargs = {}
    for name, value in tree.items():
        typ, key = hints[name], prefix + name
        if dataclasses.is_dataclass(typ):
            kwargs[name] = build(typ, value, key + ".")  # type: ignore[arg-type]
        else:
            kwargs[name] = check_type(key, value, typ)
    return cls(**kwargs)


def check_type(key: str, value: Any, typ: Any) -> Any:
    """The value if it has the declared type (ints accepted for floats); ConfigError otherwise."""
    origin = get_origin(typ)
    if origin is Literal:
        allowed = get_args(typ)
        if value not in allowed:
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in get_args(typ):
            try:
                return check_type(key, value, option)
            except ConfigError:
                continue
        if _switch(typ):
            words = [w for o in get_args(typ) for w in (["true", "false"] if o is bool else map(str, get_args(o)))]
            raise ConfigError(f"{key} = {value!r} is not allowed; choose one of {', '.join(words)}")
        raise ConfigError(f"{key} = {value!r} has the wrong type ({typ})")
    if origin is list:
        (item,) = get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r} must be a list")
        return [check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, float) and not math.isfinite(value):  # nan / inf pass every range check
        raise ConfigError(f"{key} = {value} must be a finite number")
    if typ is type(None) and value is None:
        return None
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ConfigError(f"{key} = {value!r} must be {typ.__name__}, not {type(value).__name__}")
    return value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *sections, last = dotted.split(".")
    node = tree
    for part in sections:
        node = node.setdefault(part, {})
    node[last] = value


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as nested plain dicts (for printing, JSON, the run's config.json)."""
    return dataclasses.asdict(cfg)


def to_toml(cfg: Any) -> str:
    """The effective config as TOML text (``tomli_w``, imported here: optional)."""
    return optional_import("tomli_w", "writing a config as TOML", TOMLI_W_INSTALL).dumps(to_dict(cfg))


def write_run_config(cfg: Any, folder: Path) -> Path:
    """The run's effective config into ``folder``: ``config.toml``, or ``config.json`` (one line on stderr) where
    ``tomli_w`` is not installed, so that a stock PyTorch container trains without it."""
    import json
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    try:
        text, path = to_toml(cfg), folder / "config.toml"
    except ConfigError as exc:
        text, path = json.dumps(to_dict(cfg), indent=1) + "\n", folder / "config.json"
        print(f"meshforge: wrote {path} instead of config.toml ({exc})", file=sys.stderr)
    path.write_text(text)
    return path


def check_writable(folder: Path, key: str) -> None:
    """Create ``folder`` and write a probe file in it; `ConfigError` in one line naming ``key`` when that fails (a
    run would otherwise fail at its first save, after the first steps)."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".meshforge-probe-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{key}: cannot write to {folder} ({reason}); choose a writable folder (job.dump_folder sets the root)"
        ) from None

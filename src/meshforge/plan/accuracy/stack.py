"""Stack profiles: what an implementation reaches on a device, kept apart from the device's datasheet.

A stack profile is a hardware preset's ``HardwareSpec`` (peaks, memory, links: the datasheet, untouched) with the
``Efficiency`` constants one implementation reaches on it (compute efficiency of matmul, attention and element-wise
work, the Float8 speedup, the share of the links' bandwidth its collectives reach) and a ``[stack]`` record of what
they rest on: the runs' world sizes and sources, which constants the runs determined and which stay at the preset's
(the shipped TorchTitan fit's). ``meshforge plan --calibrate RUNS --out FILE`` writes one
(plan/accuracy/stack_fit.py); ``--hardware FILE`` or a shipped name (``shipped.STACKS``: torchtitan-h100,
nemo-h100-bf16, nemo-h100-fp8) reads it everywhere a preset is read (plan, --search, --guide, bench's prediction).

The file is plain TOML written here without tomli_w (flat tables of numbers, strings, booleans and lists of them),
so a box without the optional writer still saves a profile.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from meshforge.config.io import ConfigError
from meshforge.plan import shipped
from meshforge.plan.hardware import (
    PRESETS,
    Efficiency,
    HardwareProfile,
    HardwareSpec,
    StackInfo,
    _build,
    load_hardware,
    preset_names,
)

STACK_KEYS = {"name": str, "hardware": str, "fitted": list, "held": list, "world_sizes": list, "sources": list}
"""The ``[stack]`` table's keys and their TOML types (lists: of strings; world_sizes: of integers)."""


def load_profile(name_or_path: str) -> HardwareProfile:
    """What ``--hardware`` names: a shipped stack (``shipped.STACKS``), a stack profile file, or whatever
    hardware.load_hardware reads (a preset, ``cpu``, a plain profile file)."""
    if name_or_path in shipped.STACKS:
        return shipped_stack(name_or_path)
    path = Path(name_or_path)
    if name_or_path not in preset_names() and not name_or_path.endswith(".toml") and not path.is_file():
        raise ConfigError(  # load_hardware's message, with the stacks it does not know of
            f"--hardware {name_or_path!r} is neither a preset ({', '.join(preset_names())}), a stack "
            f"({', '.join(shipped.STACKS)}) nor a TOML file (see configs/hardware/example.toml)"
        )
    return read_stack(path) or load_hardware(name_or_path)


def shipped_stack(name: str) -> HardwareProfile:
    """A shipped stack profile (``shipped.STACKS``): its preset's datasheet and family constants, with the stack's
    own constants over them."""
    entry: dict[str, Any] = dict(shipped.STACKS[name])
    base = load_hardware(str(entry["hardware"]))
    eff = replace(base.efficiency, **dict(entry["efficiency"]))  # type: ignore[call-overload]
    info = StackInfo(
        name=name,
        hardware=str(entry["hardware"]),
        fitted=tuple(entry["fitted"]),
        held=tuple(entry["held"]),
        world_sizes=tuple(int(w) for w in entry["world_sizes"]),
        sources=tuple(entry["sources"]),
    )
    return HardwareProfile(base.spec, eff, info)


def read_stack(path: Path) -> HardwareProfile | None:
    """The stack profile in ``path``, or None when the file has no ``[stack]`` table (a plain hardware profile:
    hardware.read_profile reads it)."""
    if not path.is_file():
        return None
    try:
        tree = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError:
        return None  # read_profile names the error
    if "stack" not in tree:
        return None
    unknown = sorted(set(tree) - {"stack", "hardware", "efficiency"})
    if unknown:
        raise ConfigError(
            f"--hardware {path}: unknown table {unknown[0]!r}; allowed: [stack], [hardware], [efficiency]"
        )
    info = _stack_info(tree["stack"], path)
    hw = dict(tree.get("hardware", {}))
    base_name = hw.pop("base", None)  # a preset's datasheet (GPU); none: the whole spec is in the file (a CPU host)
    if base_name is not None and base_name not in PRESETS:
        raise ConfigError(f"--hardware {path} [hardware]: base = {base_name!r} is no preset ({', '.join(PRESETS)})")
    base = load_hardware(base_name) if base_name else None
    spec = _build(HardwareSpec, hw, f"{path} [hardware]", base.spec if base else None)
    eff_base = base.efficiency if base else Efficiency()
    eff = _build(Efficiency, dict(tree.get("efficiency", {})), f"{path} [efficiency]", eff_base)
    return HardwareProfile(spec, eff, info)


def _stack_info(table: Any, path: Path) -> StackInfo:
    """The ``[stack]`` table as StackInfo; one-line ConfigError for a wrong key or type."""
    if not isinstance(table, dict):
        raise ConfigError(f"--hardware {path}: stack = {table!r} must be a table ([stack] with keys)")
    for key, value in table.items():
        want = STACK_KEYS.get(key)
        if want is None:
            raise ConfigError(f"--hardware {path} [stack]: unknown key {key!r}; allowed: {', '.join(STACK_KEYS)}")
        if not isinstance(value, want):
            raise ConfigError(f"--hardware {path} [stack]: {key} = {value!r} must be a {want.__name__}")
    sizes = table.get("world_sizes", [])
    if not all(isinstance(w, int) and w >= 1 for w in sizes):
        raise ConfigError(f"--hardware {path} [stack]: world_sizes = {sizes!r} must be integers >= 1")
    return StackInfo(
        name=str(table.get("name", path.stem)),
        hardware=str(table.get("hardware", "h100")),
        fitted=tuple(str(x) for x in table.get("fitted", [])),
        held=tuple(str(x) for x in table.get("held", [])),
        world_sizes=tuple(sizes),
        sources=tuple(str(x) for x in table.get("sources", [])),
    )


def profile_tree(profile: HardwareProfile) -> dict[str, dict[str, Any]]:
    """The TOML tables of a profile: [stack] when it has one; [hardware] as base = its preset plus the fields that
    differ from it (the whole spec when it is no preset, or a probed CPU); the full [efficiency]."""
    spec = dataclasses.asdict(profile.spec)
    preset = PRESETS.get(profile.spec.name)
    if preset is not None:
        hardware = {"base": profile.spec.name} | {
            k: v for k, v in spec.items() if v != getattr(preset, k) and k not in ("name", "description")
        }
    else:
        hardware = spec
    tree: dict[str, dict[str, Any]] = {}
    if profile.stack is not None:
        tree["stack"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(profile.stack).items()
        }
    tree["hardware"] = hardware
    tree["efficiency"] = dataclasses.asdict(profile.efficiency)
    return tree


def dumps(tree: dict[str, dict[str, Any]]) -> str:
    """TOML for flat tables of str / int / float / bool and lists of them (what tomllib reads back to the same)."""
    lines: list[str] = []
    for table, values in tree.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML cannot hold {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def save(profile: HardwareProfile, path: Path) -> None:
    """Write ``profile`` (a stack profile or a plain one) as TOML that ``load_hardware(path)`` reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    what = "stack" if profile.stack is not None else "hardware"
    header = f"# meshforge {what} profile (meshforge plan --hardware THIS_FILE)\n"
    path.write_text(header + dumps(profile_tree(profile)))

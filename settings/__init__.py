"""Settings from defaults < YAML file < `NIGHTSHIFT_*` environment < command-line
flags, into a stage's config dataclass.

YAML: top-level `data:` (shared by every stage) and one section per stage
(`collector:`). Environment: `NIGHTSHIFT_DATA`, `NIGHTSHIFT_<SECTION>_<KEY>`, and
for nested settings `NIGHTSHIFT_<SECTION>_<GROUP>_<KEY>` (lists comma-separated,
mappings as JSON). Sizes accept `64MiB`, `2GB`, …; durations `10s`, `5m`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from typing import Any

import yaml

SHARED = ("data",)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "tib": 1024**4}
_DUR = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


class SettingsError(ValueError):
    pass


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            s = str(value).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if tp is int:
            if isinstance(value, int):
                return value
            m = re.fullmatch(r"\s*([0-9_.]+)\s*([A-Za-z]*)\s*", str(value))
            if not m or m.group(2).lower() not in _UNITS:
                raise ValueError(f"not a size or integer: {value!r}")
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if tp is float:
            if isinstance(value, (int, float)):
                return float(value)
            try:
                return float(str(value).strip())  # 1e-4: YAML 1.1 reads it as text
            except ValueError:
                pass
            m = re.fullmatch(r"\s*([0-9_.]+)\s*([A-Za-z]*)\s*", str(value))
            if not m or m.group(2).lower() not in _DUR:
                raise ValueError(f"not a number or duration: {value!r}")
            return float(m.group(1)) * _DUR[m.group(2).lower()]
        if tp is str:
            if isinstance(value, bool):  # YAML reads a bare `off`/`on` as a boolean
                return "on" if value else "off"
            return "" if value is None else str(value)
        if origin is list:
            if isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list):
                raise ValueError(f"expected a list, got {value!r}")
            return value
        if origin is dict or tp is dict:
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError(f"expected a mapping, got {value!r}")
            return value
    except (ValueError, json.JSONDecodeError) as e:
        raise SettingsError(f"{where}: {e}") from None
    return value


def _apply(obj: Any, values: dict, path: str, origin) -> None:
    """Set `values` on `obj` (a section's dataclass at `path`, e.g. `collector.redact`);
    `origin(path)` names where a value came from, for the error that names it."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        here = f"{path}.{key}"
        if key not in names:
            raise SettingsError(f"{origin(here)} ({here}): unknown setting {key!r} (known in {path}: {', '.join(sorted(names))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise SettingsError(f"{origin(here)} ({here}): expected a mapping, got {value!r}")
            _apply(current, value, here, origin)
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{origin(here)} ({here})"))


def apply(obj: Any, values: dict, source: str = "code") -> None:
    """Settings given as a mapping (nested sections as mappings, as in the YAML file)
    onto a config dataclass, coerced and checked like any other source."""
    _apply(obj, values, type(obj).__name__, lambda path: source)


def _env(obj: Any, prefix: str, env: dict, shared: bool, path: str, names: dict[str, str]) -> dict:
    """The values set by environment variables, and (in `names`) each one's variable."""
    out: dict = {}
    for f in dataclasses.fields(obj):
        name = f"NIGHTSHIFT_{f.name.upper()}" if shared and f.name in SHARED else f"{prefix}_{f.name.upper()}"
        current = getattr(obj, f.name)
        if dataclasses.is_dataclass(current):
            sub = _env(current, name, env, False, f"{path}.{f.name}", names)
            if sub:
                out[f.name] = sub
        elif name in env:
            out[f.name] = env[name]
            names[f"{path}.{f.name}"] = f"{name}={env[name]!r}"
    return out


def load(cls: type, section: str, config_file: str | None = None, flags: dict | None = None,
         env: dict | None = None) -> Any:
    obj = cls()
    if config_file:
        try:
            with open(config_file) as fh:
                doc = yaml.safe_load(fh) or {}
        except OSError as e:
            raise SettingsError(f"cannot read config file {config_file}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise SettingsError(f"{config_file} is not valid YAML: {e}") from None
        if not isinstance(doc, dict):
            raise SettingsError(f"{config_file}: expected a mapping at the top level")
        names = {f.name for f in dataclasses.fields(obj)}
        top = {k: doc[k] for k in SHARED if k in doc and k in names}
        sec = doc.get(section) or {}
        if not isinstance(sec, dict):
            raise SettingsError(f"{config_file}: `{section}:` must be a mapping")
        _apply(obj, {**top, **sec}, section, lambda path: config_file)
    var_of: dict[str, str] = {}
    values = _env(obj, f"NIGHTSHIFT_{section.upper()}", os.environ if env is None else env, True, section, var_of)
    _apply(obj, values, section, lambda path: var_of.get(path, "environment"))
    _apply(obj, {k: v for k, v in (flags or {}).items() if v is not None}, section,
           lambda path: "--" + path.rsplit(".", 1)[-1].replace("_", "-"))
    return obj


def setting(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING,
            choices: tuple = (), metavar: str = "") -> Any:
    """A config field with the documentation its flag and `--help` are made from."""
    meta = {"help": help, "choices": choices, "metavar": metavar}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def add_flags(parser, cls: type, *, required: tuple[str, ...] = ()) -> None:
    """One `--flag` per field of `cls` declared with `setting(...)`: the name with
    dashes, the help text and default from the declaration. Values stay text here
    and are coerced by `load`, so a flag, an env var and a YAML key are read alike."""
    import argparse

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        kw: dict[str, Any] = {"dest": f.name, "default": None}
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = (f" (default {default})" if default not in (None, "", 0) and hints[f.name] is not bool
                 and f.name not in required else "")
        kw["help"] = f.metadata["help"] + shown
        if f.name in required:
            kw["required"] = True
        if hints[f.name] is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            if f.metadata.get("choices"):
                kw["choices"] = list(f.metadata["choices"])
            kw["metavar"] = f.metadata.get("metavar") or None
        parser.add_argument(flag, **kw)


def flags_of(cls: type, args: Any) -> dict:
    """The values of `add_flags`' flags the user gave (None: not given)."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls) if "help" in f.metadata}


def check_choices(obj: Any, section: str) -> None:
    """Every `setting(choices=...)` of `obj` holds one of its choices: one validation
    style for the choices declared with the settings."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices") if f.metadata else None
        if choices and getattr(obj, f.name) not in choices:
            raise SettingsError(f"{section}.{f.name} must be one of {', '.join(map(str, choices))}, "
                                f"got {getattr(obj, f.name)!r}")

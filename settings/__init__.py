"""Settings from defaults < YAML file < `NIGHTSHIFT_*` environment < command-line
flags, into a stage's config dataclass: one loader and one validation for every
stage, so a setting is read, checked and explained the same way wherever it is.

Each stage declares its settings once, as dataclass fields made with
`setting(default, help=..., choices=..., bounds=...)`. From that one declaration
come the YAML key, the environment variable, the command-line flag and its
`--help` line (`add_flags`), and the check of its value (`validate`), whose error
names the setting, the value and where it came from (the file, the variable, the
flag).

YAML: top-level `data:` (shared by every stage) and one section per stage
(`collector:`). Environment: `NIGHTSHIFT_DATA`, `NIGHTSHIFT_<SECTION>_<KEY>`, and
for nested settings `NIGHTSHIFT_<SECTION>_<GROUP>_<KEY>` (lists comma-separated,
mappings as JSON). Flags: `--key`, and `--group-key` for nested settings. Sizes
accept `64MiB`, `2GB`, …; durations `10s`, `5m`.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import typing
from typing import Any, Callable

SHARED = ("data",)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "tib": 1024**4}
_DUR = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


class SettingsError(ValueError):
    """A setting that cannot be used. `setting`: its path inside the section, when a
    config's own cross-field rule raised it (`invalid`), so the loader can say where
    the value came from."""

    def __init__(self, message: str, setting: str = "") -> None:
        super().__init__(message)
        self.setting = setting


def invalid(path: str, message: str) -> SettingsError:
    """The error a config's `rules()` raises for the setting at `path` (relative to its
    section, e.g. `credit.gamma`); `validate` adds the section and where it was set."""
    return SettingsError(message, path)


# --- declaring ----------------------------------------------------------------------------------


def setting(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING,
            choices: tuple = (), bounds: str = "", pattern: str = "", regex: bool = False, metavar: str = "",
            flag: str = "", old_flags: tuple[str, ...] = (), check: Callable[[Any], str] | None = None) -> Any:
    """A config field with what its flag, its `--help` line and its check are made from.

    `choices`: the values it may take. `bounds`: an interval it must lie in, written
    as a mathematician would (`[0, 1)`, `(0, inf)`, `[1, 512]`). `pattern`: a regex
    a text value must match whole (empty text always passes: "not set").
    `regex`: the value is itself a regex and must compile. `check`: a function
    saying what is wrong with a (non-empty) value, "" when nothing is: the checks
    of a kind of value shared by several stages (`listen_address`). `flag`: the
    flag's name when it is not `--<key>` (kept for flags that predate the
    declaration). `old_flags`: names the flag had before a rename; they still work,
    and the command says once that they are deprecated (scripts keep running while
    their authors learn the new name).

    The rule for a rename: the flag follows the name users see on every command
    (`--checkpoints`); the YAML key and the environment variable stay what they
    were (`train.output`, NIGHTSHIFT_TRAIN_OUTPUT), because settings files in
    deployments outlive a release, and `--help` names the key beside the flag."""
    if bounds:
        _interval(bounds)  # a typo in a declaration fails at import, not on a user's value
    meta = {"help": help, "choices": tuple(choices), "bounds": bounds, "pattern": pattern, "regex": regex,
            "metavar": metavar, "flag": flag, "old_flags": tuple(old_flags), "check": check}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _interval(text: str) -> tuple[bool, float, float, bool]:
    m = re.fullmatch(r"\s*([\[(])\s*(-?inf|[-+0-9.e]+)\s*,\s*(-?inf|[-+0-9.e]+)\s*([\])])\s*", text)
    if not m:
        raise ValueError(f"bounds {text!r}: write an interval such as [0, 1) or (0, inf)")
    return m.group(1) == "[", float(m.group(2)), float(m.group(3)), m.group(4) == "]"


def _problem(f: dataclasses.Field, value: Any) -> str:
    """What is wrong with `value` for the declared field `f`, or "" when nothing is.
    A list's constraints hold for each of its items."""
    meta = f.metadata or {}
    if isinstance(value, list):
        for item in value:
            problem = _problem(f, item)
            if problem:
                return f"{problem} (in {value!r})"
        return ""
    if meta.get("choices") and value not in meta["choices"]:
        return f"must be one of {', '.join(map(str, meta['choices']))}, got {value!r}"
    if meta.get("bounds") and isinstance(value, (int, float)) and not isinstance(value, bool):
        closed_lo, lo, hi, closed_hi = _interval(meta["bounds"])
        # NaN compares false with everything, so it is never inside
        if not ((value >= lo if closed_lo else value > lo) and (value <= hi if closed_hi else value < hi)):
            return f"must be in {meta['bounds']}, got {value!r}"
    if meta.get("pattern") and isinstance(value, str) and value and not re.fullmatch(meta["pattern"], value):
        return f"{value!r} is not of the form {meta.get('metavar') or meta['pattern']}"
    if meta.get("regex") and isinstance(value, str):
        try:
            re.compile(value.removeprefix("re:"))
        except re.error as e:
            return f"not a valid regex: {e} (in {value!r})"
    if meta.get("check") and value not in ("", None):
        return meta["check"](value)
    return ""


# --- addresses ----------------------------------------------------------------------------------

_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def host_problem(host: str) -> str:
    """What is wrong with a host to listen on (a name, an IPv4 or an IPv6 address),
    or "". Checked here so that a typo is a sentence before start-up, not an error
    from a socket library after half of a process has started."""
    if not host:
        return "the host is missing (0.0.0.0 listens on every interface, 127.0.0.1 on this machine only)"
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{host!r} is not an IPv6 address"
        return ""
    if re.fullmatch(r"[0-9.]+", host):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address"
        return ""
    if len(host) > 253 or not _HOSTNAME.fullmatch(host):
        return f"{host!r} is not a host name or an IP address"
    return ""


def split_address(text: str, form: str = "HOST:PORT") -> tuple[str, int]:
    """(host, port) of `HOST:PORT` or `[IPV6]:PORT`, or ValueError saying what is
    wrong with it. Every listener's address goes through here, so a port past
    65535 is refused instead of wrapped around (99999 became 34463 in gRPC) and
    each stage says it the same way."""
    m = re.fullmatch(r"\[([^\]]*)\]:([0-9]+)|([^:\[\]]*):([0-9]+)", text.strip())
    if not m:
        if text.count(":") > 1 and not text.strip().startswith("["):
            raise ValueError(f"{text!r}: an IPv6 host goes in brackets, e.g. [::1]:8000")
        raise ValueError(f"{text!r} is not of the form {form}")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in 1..65535, got {port}")
    problem = host_problem(host)
    if problem:
        raise ValueError(problem)
    return host, port


def listen_address(value: str) -> str:
    """A `check` for HOST:PORT settings."""
    try:
        split_address(value)
    except ValueError as e:
        return str(e)
    return ""


def listen_address_or_off(value: str) -> str:
    """A `check` for HOST:PORT settings where `off` turns the listener off."""
    if value == "off":
        return ""
    try:
        split_address(value, "HOST:PORT|off")
    except ValueError as e:
        return str(e)
    return ""


def _suggest(name: str, known) -> str:
    """` (did you mean 'route'?)` when `name` looks like a typo of a known name."""
    import difflib  # here: a collector that starts without a typo never needs it

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --- reading ------------------------------------------------------------------------------------


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
        if isinstance(value, bool) and tp in (int, float):  # YAML's `true`: an int to Python, a typo to anyone
            raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        if tp is int:
            if isinstance(value, int):
                return value
            m = re.fullmatch(r"\s*([0-9_.]+)\s*([A-Za-z]*)\s*", str(value))
            if not m or m.group(2).lower() not in _UNITS:
                raise ValueError(f"not a size or integer: {value!r}")
            digits = m.group(1)
            number = (float(digits) if "." in digits else int(digits)) * _UNITS[m.group(2).lower()]
            if number != int(number):  # 30.9 used to become 30 without a word; 1.5KiB is a whole 1536
                raise ValueError(f"not a whole number: {value!r}")
            return int(number)
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


def _apply(obj: Any, values: dict, path: str, origin: Callable[[str], str], where: dict[str, str]) -> None:
    """Set `values` on `obj` (a section's dataclass at `path`, e.g. `collector.redact`);
    `origin(path)` names where a value came from, for the error that names it, and
    `where` keeps it for the checks that run once every source is in."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        here = f"{path}.{key}"
        if key not in names:
            hint = _suggest(str(key), names) or f" (known in {path}: {', '.join(sorted(names))})"
            raise SettingsError(f"{origin(here)} ({here}): unknown setting {key!r}{hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise SettingsError(f"{origin(here)} ({here}): expected a mapping, got {value!r}")
            _apply(current, value, here, origin, where)
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{origin(here)} ({here})"))
            where[here] = origin(here)


def apply(obj: Any, values: dict, source: str = "code") -> None:
    """Settings given as a mapping (nested sections as mappings, as in the YAML file)
    onto a config dataclass, coerced and checked like any other source."""
    _apply(obj, values, type(obj).__name__, lambda path: source, {})


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


@dataclasses.dataclass(frozen=True)
class Moved:
    """Settings (`keys`, top-level in their section) that moved from section `old` to
    section `new`: read from `new:` and NIGHTSHIFT_<NEW>_*, and still from `old:`
    and NIGHTSHIFT_<OLD>_*, because settings files in deployments outlive a
    release. An old place used leaves a note naming the new key (`load`'s `notes`);
    both places given, with different values, is an error naming both, since
    either guess could publish to the wrong server."""

    keys: tuple[str, ...]
    old: str
    new: str


def _section(doc: dict, name: str, config_file: str) -> dict:
    sec = doc.get(name) or {}
    if not isinstance(sec, dict):
        raise SettingsError(f"{config_file}: `{name}:` must be a mapping")
    return sec


def _moved(section: str, own: dict, other: dict, moved: Moved, label: Callable[[str, str], str],
           notes: list[str] | None, source: str = "") -> dict:
    """`own` (the values given in `section`'s place) with `moved.keys` read from both
    places: the new one's, else the old one's with a note. `other`: the values given
    in the other place; `label(section, key)` names a key in the words of the source
    (`nightly.vllm_url` in a file, NIGHTSHIFT_NIGHTLY_VLLM_URL in the environment);
    `source`: the file, when they come from one."""
    said = f"{source}: " if source else ""
    is_new = section == moved.new
    for key in other if not is_new else ():  # read for its moved keys only: anything else there is a typo
        if key not in moved.keys:
            hint = _suggest(str(key), moved.keys) or f" (known in {moved.new}: {', '.join(sorted(moved.keys))})"
            raise SettingsError(f"{said}{label(moved.new, str(key))}: unknown setting {str(key)!r}{hint}")
    new = own if is_new else {k: other[k] for k in moved.keys if k in other}
    old = {k: (other if is_new else own)[k] for k in moved.keys if k in (other if is_new else own)}
    out = {**({k: v for k, v in own.items() if k not in moved.keys} if not is_new else own), **new}
    for key, value in old.items():
        was, now = label(moved.old, key), label(moved.new, key)
        if key in new:
            if str(new[key]) != str(value):
                raise SettingsError(f"{said}{now} ({new[key]!r}) and {was} ({value!r}) are both given and differ: keep "
                                    f"{now} and remove {was} (its old place, deprecated)")
        else:
            out[key] = value
        note = f"{said}{was} is deprecated: use {now} (the same setting; {was} still works for now)"
        if notes is not None and note not in notes:
            notes.append(note)
    return out


def load(cls: type, section: str, config_file: str | None = None, flags: dict | None = None,
         env: dict | None = None, *, check: bool = True, moved: Moved | None = None,
         notes: list[str] | None = None) -> Any:
    """`cls()` with the YAML file's `section:` (and top-level `data:`), then the
    `NIGHTSHIFT_<SECTION>_*` variables, then `flags` (a mapping, nested like the
    YAML; None values are flags not given) applied in that order, then validated
    (`validate`) unless `check` is false. `moved`: settings that also have (or had)
    another section (`Moved`); what the command should say about an old place
    used goes to `notes`."""
    obj = cls()
    where: dict[str, str] = {}
    if config_file:
        doc = read_file(config_file)
        names = {f.name for f in dataclasses.fields(obj)}
        top = {k: doc[k] for k in SHARED if k in doc and k in names}
        sec = _section(doc, section, config_file)
        if moved is not None:
            other = _section(doc, moved.old if section == moved.new else moved.new, config_file)
            sec = _moved(section, sec, other, moved, lambda s, k: f"{s}.{k}", notes, config_file)
        _apply(obj, {**top, **sec}, section, lambda path: config_file, where)
    var_of: dict[str, str] = {}
    environ = os.environ if env is None else env
    values = _env(obj, f"NIGHTSHIFT_{section.upper()}", environ, True, section, var_of)
    if moved is not None:
        there = moved.old if section == moved.new else moved.new
        other = _env(obj, f"NIGHTSHIFT_{there.upper()}", environ, False, section, {})
        values = _moved(section, values, other, moved, lambda s, k: f"NIGHTSHIFT_{s.upper()}_{k.upper()}", notes)
        for key in moved.keys:
            if key in values and f"{section}.{key}" not in var_of:
                for s in (moved.new, moved.old):
                    name = f"NIGHTSHIFT_{s.upper()}_{key.upper()}"
                    if name in environ:
                        var_of[f"{section}.{key}"] = f"{name}={environ[name]!r}"
                        break
    _apply(obj, values, section, lambda path: var_of.get(path, "environment"), where)
    flag_of = {f"{section}.{path}": name for path, name in flag_names(cls).items()}
    _apply(obj, _given(flags or {}), section,
           lambda path: flag_of.get(path, "--" + path.rsplit(".", 1)[-1].replace("_", "-")), where)
    if check:
        validate(obj, section, where)
    return obj


def read_file(config_file: str) -> dict:
    """The YAML settings file as a mapping, or a SettingsError naming the file and
    what is wrong with it (unreadable, not UTF-8, not YAML, not a mapping)."""
    import yaml  # here: a sidecar configured by flags and environment alone never pays its 1 MiB

    try:
        with open(config_file, "rb") as fh:
            raw = fh.read()
        doc = yaml.safe_load(raw.decode("utf-8")) or {}
    except OSError as e:
        raise SettingsError(f"cannot read config file {config_file}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a file saved as Latin-1, or not text at all
        line = raw.count(b"\n", 0, e.start) + 1
        raise SettingsError(f"{config_file} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}): "
                            "save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"{config_file} is not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"{config_file}: expected a mapping at the top level")
    return doc


def check_sections(config_file: str, known) -> None:
    """Every top-level key of the YAML file is one of `known` (the shared keys and
    the stages' sections, which only the caller knows: settings/ imports no stage),
    so that a misspelt section (`rout:`) is refused instead of silently ignored
    with everything in it."""
    for name in read_file(config_file):
        if name not in known:
            hint = _suggest(str(name), known) or f" (known: {', '.join(sorted(known))})"
            raise SettingsError(f"{config_file}: unknown section {str(name)!r}{hint}")


def _given(flags: dict) -> dict:
    """The flags the user gave (None: not given), nested groups included."""
    return {k: _given(v) if isinstance(v, dict) else v for k, v in flags.items() if v is not None}


# --- checking -----------------------------------------------------------------------------------


def _declared(obj: Any, path: str):
    """(path, field, value) of every field of `obj` and its nested sections."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _declared(value, f"{path}.{f.name}")
        else:
            yield f"{path}.{f.name}", f, value


def validate(obj: Any, section: str, where: dict[str, str] | None = None) -> None:
    """Every declared constraint of `obj` and its nested sections, then its own rules
    between settings (a `rules()` method raising `invalid(path, message)`): one style
    of check and of message for every stage. `where` (from `load`) names the source
    of each value set; a value nobody set is the default."""
    where = where or {}

    def named(path: str, problem: str) -> SettingsError:
        source = where.get(path)
        return SettingsError(f"{source} ({path}): {problem}" if source else f"{path}: {problem}")

    for path, f, value in _declared(obj, section):
        problem = _problem(f, value)
        if problem:
            raise named(path, problem)
    rules = getattr(obj, "rules", None)
    if rules is not None:
        try:
            rules()
        except SettingsError as e:
            if not e.setting:
                raise
            raise named(f"{section}.{e.setting}", str(e)) from None


# --- the log's format ---------------------------------------------------------------------------

LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "NIGHTSHIFT_LOG_FORMAT"


def log_format(config_file: str | None = None, flag: str | None = None, env: dict | None = None) -> str:
    """`text` or `json`, for every command and server alike: --log-format, else
    NIGHTSHIFT_LOG_FORMAT, else the YAML file's top-level `log_format:`, else text.
    Top-level like `data:`, since how a process writes its log is the deployment's
    choice, not one stage's: the one file that says json makes every process it
    configures write JSON lines."""
    env = os.environ if env is None else env
    sources = [(flag, "--log-format"), (env.get(LOG_FORMAT_ENV), LOG_FORMAT_ENV)]
    for value, where in sources:
        if value not in (None, ""):
            return _log_format(value, where)
    if config_file:
        value = read_file(config_file).get("log_format")
        if value is not None:
            return _log_format(value, config_file)
    return "text"


def _log_format(value: Any, where: str) -> str:
    text = str(value).strip().lower()
    if text not in LOG_FORMATS:
        raise SettingsError(f"{where} (log_format): must be one of {', '.join(LOG_FORMATS)}, got {value!r}")
    return text


# --- the command line ---------------------------------------------------------------------------


def flag_names(cls: type, prefix: str = "") -> dict[str, str]:
    """Each declared setting's flag: `--key`, `--group-key` for nested ones, or the
    name its declaration gives; keyed by the setting's path inside the section."""
    out = {}
    for f in dataclasses.fields(cls):
        if _nested(cls, f):
            out.update(flag_names(_nested(cls, f), f"{prefix}{f.name}."))
        elif "help" in (f.metadata or {}):
            out[prefix + f.name] = f.metadata.get("flag") or "--" + (prefix + f.name).replace(".", "-").replace("_", "-")
    return out


def _nested(cls: type, f: dataclasses.Field) -> type | None:
    tp = typing.get_type_hints(cls).get(f.name)
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _metavar(tp: Any, f: dataclasses.Field) -> str | None:
    if f.metadata.get("metavar"):
        return f.metadata["metavar"]
    origin = typing.get_origin(tp)
    if f.metadata.get("choices"):
        names = ",".join(map(str, f.metadata["choices"]))
        return names if origin is list else "{" + names + "}"
    if origin is list:
        return "A,B"
    if origin is dict or tp is dict:
        return "JSON"
    return {int: "N", float: "X"}.get(tp, "TEXT")


def _shown_default(f: dataclasses.Field, tp: Any) -> str:
    if tp is bool:
        return ""
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    if default in (None, "", 0, [], {}):
        return ""
    if isinstance(default, list):
        default = ",".join(map(str, default))
    elif f.metadata.get("metavar") == "SIZE":
        default = _size_text(default)
    elif f.metadata.get("metavar") == "DURATION":
        default = _duration_text(default)
    return f" (default {default})"


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _duration_text(seconds: float) -> str:
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def add_flags(parser: argparse.ArgumentParser, cls: type, *, section: str = "", only: tuple[str, ...] = (),
              required: tuple[str, ...] = ()) -> None:
    """One flag per setting of `cls` declared with `setting(...)`: the name with dashes
    (`--group-key` for nested ones), the help text and default from the declaration,
    nested sections in groups of their own. `only`: just these settings (paths).
    Values stay text here and are coerced and checked by `load`, so a flag, an
    environment variable and a YAML key are read alike."""
    names = flag_names(cls)
    groups: dict[str, Any] = {}
    for path, flag in names.items():
        if only and path not in only:
            continue
        owner, f, tp = _field(cls, path)
        group = path.rpartition(".")[0]
        target = parser
        if group:
            if group not in groups:
                where = f"{section}: {group}:" if section else group
                env = f"NIGHTSHIFT_{section.upper()}_{group.upper().replace('.', '_')}_*" if section else ""
                desc = (owner.__doc__ or "").strip().split("\n\n")[0]
                groups[group] = parser.add_argument_group(
                    f"{section + '.' if section else ''}{group} (YAML {where}{', env ' + env if env else ''})",
                    " ".join(desc.split()) if desc and not desc.startswith(owner.__name__ + "(") else None)
            target = groups[group]
        text = f.metadata["help"] + ("" if path in required else _shown_default(f, tp))
        key = f"{section}.{path}" if section else path
        if flag != "--" + path.replace(".", "-").replace("_", "-"):
            text += f" [YAML {key}]"  # a flag renamed for users keeps its YAML key: say which
        old = tuple(f.metadata.get("old_flags") or ())
        if old:
            text += f"; {', '.join(old)}: its old name, deprecated"
        kw: dict[str, Any] = {"dest": path.replace(".", "__"), "default": None, "help": text.replace("%", "%%")}
        if path in required:
            kw["required"] = True
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:  # choices are checked by `validate`, with the message every source gets
            kw["metavar"] = _metavar(tp, f)
            if old:
                kw.update(action=Renamed, old=old)
        target.add_argument(flag, *old, **kw)


#: Where `Renamed` leaves what the command should say about the flags it was given.
NOTES = "deprecated_flags"


class Renamed(argparse.Action):
    """A flag that may also be given by the names it had before (`old`): the value
    counts either way, and an old name leaves a note (`notes`) that the command
    says once, in its log format, so a script keeps working and its author learns
    the new name."""

    def __init__(self, option_strings, dest, old: tuple[str, ...] = (), **kw) -> None:
        self.old = tuple(old)
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        if option_string in self.old:
            note = (f"{option_string} is deprecated: use {self.option_strings[0]} "
                    f"(the same setting; {option_string} still works for now)")
            said = list(getattr(namespace, NOTES, None) or [])
            if note not in said:
                setattr(namespace, NOTES, said + [note])


def notes(args: argparse.Namespace) -> list[str]:
    """What the parsed flags left to say (a deprecated name used), each once."""
    return list(getattr(args, NOTES, None) or [])


def _field(cls: type, path: str) -> tuple[type, dataclasses.Field, Any]:
    """The dataclass that declares the setting at `path`, its field and its type."""
    head, _, rest = path.partition(".")
    f = next(x for x in dataclasses.fields(cls) if x.name == head)
    if rest:
        return _field(_nested(cls, f), rest)
    return cls, f, typing.get_type_hints(cls)[head]


def flags_of(cls: type, args: argparse.Namespace) -> dict:
    """The values of `add_flags`' flags, nested like the YAML, for `load` (None: not given)."""
    out: dict = {}
    for path in flag_names(cls):
        value = getattr(args, path.replace(".", "__"), None)
        if value is None:
            continue
        *groups, key = path.split(".")
        node = out
        for g in groups:
            node = node.setdefault(g, {})
        node[key] = value
    return out

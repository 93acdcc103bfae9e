"""Loading the cluster config from TOML: parse, validate, overlay a base, and write back.

``load_config(path)`` reads one file (``None``: the embedded single-machine default); a file
with ``base = "default"`` or ``base = "other.toml"`` lists only what differs from that base.
The dataclasses and their validation are in :mod:`tessera.config`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tessera.config import (
    ClusterConfig,
    CompositionConfig,
    ControlConfig,
    GenerationNodeConfig,
    HAConfig,
    KVPoolNodeConfig,
    ListenerConfig,
    ModelConfig,
    RetrievalConfig,
    SecurityConfig,
    SGLangConfig,
    TransportConfig,
)
from tessera.errors import ConfigError

DEFAULT_CONFIG = Path(__file__).with_name("tessera.toml")

_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "composition": CompositionConfig,
    "control": ControlConfig,
    "retrieval": RetrievalConfig,
    "transport": TransportConfig,
    "security": SecurityConfig,
    "listener": ListenerConfig,
    "ha": HAConfig,
    "sglang": SGLangConfig,
}


def _build(cls: type, section: str, raw: object) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"[{section}] must be a table, got {type(raw).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) in [{section}]: {', '.join(unknown)}; allowed: {', '.join(known)}")
    raw = {k: tuple(v) if isinstance(v, list) and isinstance(known[k].default, tuple) else v
           for k, v in raw.items()}
    for key, value in raw.items():
        default = known[key].default
        if default is dataclasses.MISSING or default is None:
            continue
        # TOML ints are fine where floats are expected; anything else must match the default's type
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            continue
        if type(value) is not type(default):
            raise ConfigError(f"{section}.{key} = {value!r} is invalid: expected {type(default).__name__}")
    return cls(**raw)


def parse_config(raw: Mapping[str, Any]) -> ClusterConfig:
    """Build a validated :class:`ClusterConfig` from a parsed TOML mapping."""
    top_known = {f.name for f in dataclasses.fields(ClusterConfig)}
    unknown = sorted(set(raw) - top_known)
    if unknown:
        raise ConfigError(f"unknown top-level key(s): {', '.join(unknown)}; allowed: {', '.join(sorted(top_known))}")
    kwargs: dict[str, Any] = {}
    for key in ("block_tokens", "kv_dtype"):
        if key in raw:
            kwargs[key] = raw[key]
    for section, cls in _SECTIONS.items():
        if section in raw:
            kwargs[section] = _build(cls, section, raw[section])
    for section, cls in (("kvpools", KVPoolNodeConfig), ("generation", GenerationNodeConfig)):
        nodes = raw.get(section, [])
        if not isinstance(nodes, list):
            raise ConfigError(f"{section} must be an array of tables ([[{section}]]), got {type(nodes).__name__}")
        kwargs[section] = tuple(_build(cls, section, node) for node in nodes)
    return ClusterConfig(**kwargs)


def _overlay(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: tables merge key by key, ``[[kvpools]]``/``[[generation]]`` entries
    merge into the base's node of the same name (or are appended), everything else replaces."""
    out = dict(base)
    for key, value in top.items():
        if key in ("kvpools", "generation") and isinstance(value, list) and isinstance(base.get(key), list):
            nodes = [dict(n) for n in base[key]]
            by_name = {n.get("name"): n for n in nodes}
            for node in value:
                if isinstance(node, Mapping) and node.get("name") in by_name:
                    by_name[node["name"]].update(node)
                else:
                    nodes.append(node)
            out[key] = nodes
        elif isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            out[key] = {**base[key], **value}
        else:
            out[key] = value
    return out


_FILE_KEYS = ("secret_file", "keys_file", "tls_cert_file", "tls_key_file", "tls_ca_file")


def _anchor_files(raw: dict[str, Any], directory: Path) -> None:
    """Relative ``[security]`` file paths name files beside the config, like ``base =`` does
    (they resolved against the working directory: ``tessera up -c deploy/x.toml`` missed keys)."""
    security = raw.get("security")
    if not isinstance(security, dict):
        return
    for key in _FILE_KEYS:
        value = security.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            security[key] = str((directory / value).absolute())


def _read_raw(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Parsed TOML of ``path`` with its ``base`` (``"default"`` or a path relative to it) applied."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass --config PATH or omit it for the default")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    _anchor_files(raw, path.parent)
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base = {base!r} is invalid: expected \"default\" or a path to another config")
    base_path = DEFAULT_CONFIG if base == "default" else (path.parent / base)
    if base_path.resolve() in seen:
        raise ConfigError(f"{path}: base = {base!r} makes a cycle of base configs")
    return _overlay(_read_raw(base_path, (*seen, path.resolve())), raw)


def load_config(path: str | Path | None = None) -> ClusterConfig:
    """Load and validate a cluster config; ``None`` loads the embedded single-machine default.

    A file with ``base = "default"`` (or ``base = "other.toml"``) lists only what differs from
    that config; see :func:`_overlay` for how the two combine.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    return parse_config(_read_raw(path))


def config_to_dict(config: ClusterConfig) -> dict[str, Any]:
    """The inverse of :func:`parse_config` (used to hand a modified config to child processes)."""
    raw = dataclasses.asdict(config)
    raw["kvpools"] = list(raw["kvpools"])
    raw["generation"] = list(raw["generation"])
    return raw


def dump_toml(config: ClusterConfig) -> str:
    """Render a config as TOML that :func:`load_config` reads back to an equal config."""

    def fmt(value: object) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(value, (tuple, list)):
            return "[" + ", ".join(fmt(v) for v in value) + "]"
        return repr(value)

    raw = config_to_dict(config)
    lines = [f"{k} = {fmt(raw[k])}" for k in ("block_tokens", "kv_dtype")]
    for section in _SECTIONS:
        lines.append(f"\n[{section}]")
        lines += [f"{k} = {fmt(v)}" for k, v in raw[section].items()]
    for section in ("kvpools", "generation"):
        for node in raw[section]:
            lines.append(f"\n[[{section}]]")
            lines += [f"{k} = {fmt(v)}" for k, v in node.items()]
    return "\n".join(lines) + "\n"

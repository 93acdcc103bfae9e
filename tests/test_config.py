"""The cluster config loads, validates and round-trips."""

from __future__ import annotations

import tomllib

import pytest

from tessera.config import dump_toml, load_config, parse_config
from tessera.errors import ConfigError


def test_default_config_describes_the_single_machine_cluster() -> None:
    """The embedded default has one retrieval node, one kvpool and two generation nodes on loopback."""
    cfg = load_config()
    assert cfg.retrieval.host == "127.0.0.1"
    assert [n.name for n in cfg.kvpools] == ["kv0"]
    assert [n.name for n in cfg.generation] == ["gen0", "gen1"]
    assert all(n.host == "127.0.0.1" for n in cfg.generation)


def test_dump_and_load_round_trip() -> None:
    """dump_toml writes a file that parses back to an equal config."""
    cfg = load_config()
    assert parse_config(tomllib.loads(dump_toml(cfg))) == cfg


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"block_tokens": 0, "generation": [{"name": "g"}]}, "block_tokens = 0"),
        ({"kv_dtype": "int3", "generation": [{"name": "g"}]}, "kv_dtype = 'int3'"),
        ({"control": {"routing": "random"}, "generation": [{"name": "g"}]}, "control.routing = 'random'"),
        ({"control": {"window": "64"}, "generation": [{"name": "g"}]}, "control.window = '64'"),
        ({"control": {"bogus": 1}, "generation": [{"name": "g"}]}, "unknown key(s) in [control]: bogus"),
        ({"generation": []}, "at least one [[generation]]"),
        ({"generation": [{"name": "g"}, {"name": "g", "port": 1}]}, "must be unique"),
        ({"generation": [{"name": "a"}, {"name": "b"}]}, "port already used"),
        ({"generation": [{"name": "g", "port": 70000}]}, "generation.g.port = 70000"),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(raw: dict, needle: str) -> None:
    """A bad value raises ConfigError naming the key and the value."""
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert needle in str(info.value)


def test_missing_file_says_how_to_fix(tmp_path) -> None:
    """A missing config file is a ConfigError that mentions --config."""
    with pytest.raises(ConfigError, match="--config"):
        load_config(tmp_path / "nope.toml")

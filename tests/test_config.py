"""The cluster config loads, validates and round-trips."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tessera.config import ClusterConfig, GenerationNodeConfig, KVPoolNodeConfig, Role
from tessera.config_file import DEFAULT_CONFIG, dump_toml, load_config, parse_config
from tessera.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
NODE_CLASSES: dict[str, type] = {"kvpools": KVPoolNodeConfig, "generation": GenerationNodeConfig}
# each node's own name and ports, different from node to node by necessity: not defaults
NODE_IDENTITY = frozenset({"name", "port", "data_port"})


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
        ({"control": {"routing": ""}, "generation": [{"name": "g"}]}, "control.routing = ''"),
        ({"control": {"window": "64"}, "generation": [{"name": "g"}]}, "control.window = '64'"),
        ({"control": {"bogus": 1}, "generation": [{"name": "g"}]}, "unknown key(s) in [control]: bogus"),
        ({"generation": []}, "at least one [[generation]]"),
        ({"generation": [{"name": "g"}, {"name": "g", "port": 1}]}, "must be unique"),
        ({"generation": [{"name": "a"}, {"name": "b"}]}, "port already used"),
        ({"generation": [{"name": "g", "port": 70000}]}, "generation.g.port = 70000"),
        ({"listener": {"max_connections_per_peer": 0}, "generation": [{"name": "g"}]},
         "listener.max_connections_per_peer = 0"),
        ({"transport": {"max_connections": -1}, "generation": [{"name": "g"}]}, "transport.max_connections = -1"),
        ({"transport": {"max_connections_per_peer": 1.5}, "generation": [{"name": "g"}]},
         "transport.max_connections_per_peer = 1.5"),
        ({"transport": {"handshake_timeout_s": 0}, "generation": [{"name": "g"}]}, "transport.handshake_timeout_s = 0"),
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


def test_a_base_overlay_changes_only_what_it_lists(tmp_path) -> None:
    default = load_config()
    top = tmp_path / "small.toml"
    top.write_text('base = "default"\nblock_tokens = 32\n[control]\ntheta = 3.0\n'
                   '[[generation]]\nname = "gen1"\nlocal_capacity_blocks = 96\n'
                   '[[generation]]\nname = "gen2"\nport = 8602\n')
    cfg = load_config(top)
    assert cfg.block_tokens == 32
    assert cfg.control.theta == 3.0 and cfg.control.window == default.control.window
    assert [g.name for g in cfg.generation] == ["gen0", "gen1", "gen2"]
    assert cfg.generation[0] == default.generation[0]
    assert cfg.generation[1].local_capacity_blocks == 96 and cfg.generation[1].port == default.generation[1].port
    assert cfg.kvpools == default.kvpools
    # a base may itself have a base, relative to the file that names it
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.toml").write_text('base = "../small.toml"\n[composition]\nunit_lead = ""\n')
    more = load_config(tmp_path / "sub" / "more.toml")
    assert more.composition.unit_lead == "" and more.block_tokens == 32 and len(more.generation) == 3


def test_a_bad_base_says_what_is_wrong(tmp_path) -> None:
    loop = tmp_path / "loop.toml"
    loop.write_text('base = "loop.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config(loop)
    missing = tmp_path / "missing.toml"
    missing.write_text('base = "nowhere.toml"\n')
    with pytest.raises(ConfigError, match=r"nowhere\.toml.*does not exist"):
        load_config(missing)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("base = 3\n")
    with pytest.raises(ConfigError, match="expected \"default\" or a path"):
        load_config(wrong)


@pytest.mark.parametrize(
    ("section", "key", "registry_key"),
    [("composition", "policy", "composition.policy"), ("control", "admission", "control.admission"),
     ("control", "routing", "control.routing"), ("transport", "name", "transport.name"),
     ("model", "engine", "model.engine")],
)
def test_unregistered_policy_names_are_refused_naming_the_registered_ones(section: str, key: str,
                                                                          registry_key: str) -> None:
    """Every policy key is checked against its registry at start-up; the error lists the known names."""
    from tessera.roles import check_registered

    config = parse_config({section: {key: "nope"}, "generation": [{"name": "g"}]})
    with pytest.raises(ConfigError) as info:
        check_registered(config)
    assert f"{registry_key} = 'nope' is not registered; known:" in str(info.value)


def test_only_a_memory_node_leaves_the_engine_name_unchecked() -> None:
    """A memory node builds no engine (and must not import torch to check the name); every other role checks it."""
    from tessera.roles import check_registered

    config = parse_config({"model": {"engine": "nope"}, "generation": [{"name": "g"}]})
    check_registered(config, Role.kvpool)
    for role in (Role.generation, Role.retrieval, None):
        with pytest.raises(ConfigError, match=r"model\.engine = 'nope'"):
            check_registered(config, role)


def test_a_routing_policy_registered_by_the_user_is_accepted() -> None:
    """The config consults the registry instead of a whitelist, so a user's own router loads."""
    from tessera.control.router import ROUTERS, LoadRouter
    from tessera.roles import check_registered

    ROUTERS.register("mine")(type("MyRouter", (LoadRouter,), {}))
    try:
        check_registered(parse_config({"control": {"routing": "mine"}, "generation": [{"name": "g"}]}))
    finally:
        ROUTERS.unregister("mine")
    with pytest.raises(ConfigError):
        check_registered(parse_config({"control": {"routing": "mine"}, "generation": [{"name": "g"}]}))


def test_the_embedded_config_is_the_only_copy_of_the_default() -> None:
    """The default cluster lives in ``tessera/tessera.toml`` alone (no copy at the repository root,
    which would drift from it comment by comment); a file of one's own says ``base = "default"``."""
    from tessera.config_file import DEFAULT_CONFIG

    repository = Path(__file__).resolve().parent.parent
    assert repository / "tessera" / "tessera.toml" == DEFAULT_CONFIG
    copies = [p for p in repository.glob("*.toml") if p.read_bytes() == DEFAULT_CONFIG.read_bytes()]
    assert not (repository / "tessera.toml").exists() and not copies, copies


def field_default(cls: type, key: str) -> Any:
    """The default of dataclass field ``key`` of ``cls`` (a section's: its factory's value)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == key)
    if f.default is not dataclasses.MISSING:
        return f.default
    assert f.default_factory is not dataclasses.MISSING, f"{cls.__name__}.{key} has no default"
    return f.default_factory()


def stated_values(raw: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any]]:
    """(key, the value a config file states, the dataclass default) for every value it states."""
    for key, value in raw.items():
        if key in NODE_CLASSES:
            for node in value:
                yield from ((f"{key}.{node['name']}.{k}", v, field_default(NODE_CLASSES[key], k))
                            for k, v in node.items() if k not in NODE_IDENTITY)
        elif isinstance(value, dict):
            section = field_default(ClusterConfig, key)
            yield from ((f"{key}.{k}", v, getattr(section, k)) for k, v in value.items())
        else:
            yield key, value, field_default(ClusterConfig, key)


def test_the_embedded_config_restates_only_the_dataclass_defaults() -> None:
    """Regression: the embedded TOML gave capacity_blocks, local_capacity_blocks and
    max_batch_tokens other values than the dataclasses; every value it states must be the default."""
    stated = list(stated_values(tomllib.loads(DEFAULT_CONFIG.read_text())))
    assert {key: (value, default) for key, value, default in stated if value != default} == {}


def test_a_node_a_file_leaves_unspecified_gets_the_served_sizes() -> None:
    """A [[generation]] or [[kvpools]] entry that names only itself is sized like the embedded cluster's nodes."""
    cfg = parse_config({"generation": [{"name": "g"}], "kvpools": [{"name": "k"}]})
    default = load_config()
    gen, pool = default.generation[0], default.kvpools[0]
    assert dataclasses.replace(cfg.generation[0], name=gen.name, port=gen.port) == gen
    assert dataclasses.replace(cfg.kvpools[0], name=pool.name, port=pool.port, data_port=pool.data_port) == pool


@pytest.mark.parametrize("path", sorted((REPO / "bench").glob("*.toml")), ids=lambda p: p.name)
def test_every_bench_config_loads(path: Path) -> None:
    """The bench configs name only known keys and valid values (they overlay the embedded default)."""
    assert load_config(path).generation


def test_generation_cpus_are_cores_as_taskset_writes_them() -> None:
    from tessera.config import GenerationNodeConfig, parse_cpus

    assert parse_cpus("") == frozenset()
    assert parse_cpus("0-2,5") == frozenset({0, 1, 2, 5})
    assert GenerationNodeConfig("gen0", cpus="1").cpus == "1"
    for bad in ("2-1", "x", "-1", "0-"):
        with pytest.raises(ConfigError, match=r"generation\.gen0\.cpus"):
            GenerationNodeConfig("gen0", cpus=bad)

"""The cluster secret, signed internal requests, API keys and block MACs, in process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from helpers.kvpool import random_state, tiny_layout

from tessera.auth import Unauthorized, Verifier, block_mac_key, create_secret, read_secret, sign
from tessera.config import ClusterConfig, GenerationNodeConfig
from tessera.errors import BadRequest, ChecksumMismatch, ConfigError
from tessera.launcher import with_secret
from tessera.tenants import KeyRing
from tessera.transport.blocks import HEADER_BYTES, BlockHeader
from tessera.transport.unit_blocks import decode_unit, encode_unit

SECRET = b"0123456789abcdef0123456789abcdef"


def test_a_signed_request_verifies_once_and_only_unaltered() -> None:
    """Same method, path and body verify; any change, another secret or a replay is refused."""
    v = Verifier(SECRET, max_skew_s=30.0)
    header = sign(SECRET, "POST", "/control/publish", b'{"a":1}')
    v.verify("POST", "/control/publish", header, b'{"a":1}')
    with pytest.raises(Unauthorized, match="replayed"):
        v.verify("POST", "/control/publish", header, b'{"a":1}')
    for method, path, body in (("GET", "/control/publish", b'{"a":1}'), ("POST", "/control/cancel", b'{"a":1}'),
                               ("POST", "/control/publish", b'{"a":2}')):
        with pytest.raises(Unauthorized, match="bad signature"):
            v.verify(method, path, sign(SECRET, "POST", "/control/publish", b'{"a":1}'), body)
    with pytest.raises(Unauthorized, match="bad signature"):
        v.verify("POST", "/x", sign(b"another-secret-0123456789abcdef!", "POST", "/x"), b"")
    for bad in (None, "", "garbage", "ts=1,nonce=x"):
        with pytest.raises(Unauthorized):
            v.verify("POST", "/x", bad, b"")


def test_signatures_outside_the_skew_window_are_refused() -> None:
    """A signature from 31 s ago (or ahead) is refused with a 30 s window."""
    now = 1_000_000.0
    v = Verifier(SECRET, max_skew_s=30.0, clock=lambda: now, started=now - 3600)  # a listener up for an hour
    for t in (now - 31, now + 31):
        with pytest.raises(Unauthorized, match="off this node's clock"):
            v.verify("GET", "/x", sign(SECRET, "GET", "/x", now=t), b"")
    v.verify("GET", "/x", sign(SECRET, "GET", "/x", now=now - 29), b"")


def test_a_request_signed_before_its_listener_restarted_is_refused() -> None:
    """Regression: each process's nonce cache starts empty, so a request captured and
    accepted before a node restarted was accepted once more by the new process within the skew
    window. A signature older than the listener's start (less a 2 s grace) is refused."""
    now = 1_000_000.0
    before = sign(SECRET, "POST", "/v1/abort", b"{}", now=now - 10)
    old = Verifier(SECRET, max_skew_s=30.0, clock=lambda: now, started=now - 3600)
    old.verify("POST", "/v1/abort", before, b"{}")  # accepted by the incarnation that saw it first
    restarted = Verifier(SECRET, max_skew_s=30.0, clock=lambda: now)  # the same listener, a new process
    with pytest.raises(Unauthorized, match="before this listener started"):
        restarted.verify("POST", "/v1/abort", before, b"{}")
    restarted.verify("POST", "/v1/abort", sign(SECRET, "POST", "/v1/abort", b"{}", now=now - 1), b"{}")  # grace
    restarted.verify("POST", "/v1/abort", sign(SECRET, "POST", "/v1/abort", b"{}", now=now), b"{}")


def test_the_secret_file_is_private_and_checked(tmp_path: Path) -> None:
    """create_secret writes 0600; a group-readable or short secret is refused with how to fix it."""
    path = tmp_path / "s"
    create_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(read_secret(str(path))) == 64
    loose = tmp_path / "loose"
    loose.write_text("x" * 64)
    os.chmod(loose, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_secret(str(loose))
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="at least 32"):
        read_secret(str(short))


def test_tessera_up_gives_every_cluster_its_own_secret(tmp_path: Path) -> None:
    """The launcher creates a 0600 secret per cluster and hands its path to every role."""
    config = ClusterConfig(generation=(GenerationNodeConfig("gen0"),))
    a, b = with_secret(config, tmp_path / "a"), with_secret(config, tmp_path / "b")
    assert a.security.secret_file != b.security.secret_file
    assert read_secret(a.security.secret_file) != read_secret(b.security.secret_file)
    assert stat.S_IMODE(Path(a.security.secret_file).stat().st_mode) == 0o600
    assert with_secret(a, tmp_path / "c").security.secret_file == a.security.secret_file  # a configured one stays


def _keys(tmp_path: Path, suffix: str = ".toml") -> KeyRing:
    tenants = [{"name": "acme", "scopes": ["docs", "support/*"], "keys": ["k-acme"]},
               {"name": "ops", "scopes": ["*"], "admin": True,
                "keys_sha256": [hashlib.sha256(b"k-ops").hexdigest()]}]
    path = tmp_path / f"keys{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"tenants": tenants}))
    else:
        lines = []
        for t in tenants:
            lines += ["[[tenants]]", *(f"{k} = {json.dumps(v)}" for k, v in t.items()), ""]
        path.write_text("\n".join(lines).replace("True", "true"))
    path.chmod(0o600)
    return KeyRing.load(path)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_api_keys_map_to_tenants_and_their_scopes(tmp_path: Path, suffix: str) -> None:
    """A key is its tenant; scopes are exact names or prefixes; unknown or missing keys are 401."""
    keys = _keys(tmp_path, suffix)
    acme = keys.authenticate("Bearer k-acme")
    assert acme.name == "acme" and not acme.admin
    assert acme.allows("docs") and acme.allows("support/tickets") and not acme.allows("docs2")
    assert keys.authenticate("Bearer k-ops").admin
    for header in (None, "", "Bearer ", "Basic k-acme", "Bearer k-guess"):
        with pytest.raises(BadRequest) as info:
            keys.authenticate(header)
        assert info.value.status == 401
    with pytest.raises(BadRequest, match="'billing': this API key may not use that scope") as info:
        acme.check_scope("billing")
    assert info.value.status == 403 and "docs" not in str(info.value)


def test_a_block_with_a_valid_crc_but_no_valid_mac_is_a_failed_fetch() -> None:
    """Regression: CRC-32 is no MAC; a forger could rewrite a block and its checksums."""
    signed = dataclasses.replace(tiny_layout(), mac_key=block_mac_key(SECRET))
    state = random_state(6, seed=1)
    blocks = encode_unit(signed, state, "u", epoch=3)
    assert decode_unit(signed, blocks, "u", 3, 6).keys.equal(state.keys)
    forged = encode_unit(tiny_layout(), random_state(6, seed=2), "u", epoch=3)  # right header, CRCs; no secret
    with pytest.raises(ChecksumMismatch, match="MAC mismatch"):
        decode_unit(signed, forged, "u", 3, 6)
    h = BlockHeader.unpack(blocks[0])
    assert h.mac != bytes(8) and len(blocks[0]) > HEADER_BYTES


def test_internal_listeners_beyond_loopback_need_a_secret() -> None:
    """A generation or memory node bound to a public interface refuses to start without a secret."""
    from tessera.config import KVPoolNodeConfig, SecurityConfig
    from tessera.roles import check_secret

    config = ClusterConfig(generation=(GenerationNodeConfig("gen0", host="0.0.0.0"),),
                           kvpools=(KVPoolNodeConfig("kv0"),))
    with pytest.raises(ConfigError, match=r"without security\.secret_file"):
        check_secret("generation", config, "gen0")
    check_secret("kvpool", config, "kv0")  # loopback only: allowed
    check_secret("generation", dataclasses.replace(config, security=SecurityConfig(secret_file="/s")), "gen0")

"""The cluster secret and what it authenticates: internal requests, TLS contexts, capabilities.

Every process of one cluster reads the same secret file (``security.secret_file``, 0600,
created by ``tessera up``). Holding it is what makes a process part of the cluster: the
internal plane (``/control/*``, the generation nodes' API, the memory nodes' ``/info``)
refuses any request that does not carry

    X-Tessera-Auth: ts=<unix seconds>,nonce=<hex>,sig=<hex HMAC-SHA256>

where ``sig = HMAC(secret, method \\n raw path \\n ts \\n nonce \\n sha256(body))``. A request
older or newer than ``security.max_clock_skew_s`` is refused, and so is a nonce seen within
that window (a captured request cannot be replayed). Refusal is a 401 from a middleware that
runs before any handler, so no state is touched.

Capabilities (:func:`capability`) are HMACs of the same secret over what a data-plane
request may touch; the memory node checks them (see :mod:`tessera.transport.tcp_server`).

Only the standard library's ``hmac``, ``hashlib``, ``secrets`` and ``ssl`` are used.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from tessera.config import ClusterConfig, SecurityConfig
from tessera.errors import ConfigError
from tessera.messages import BlockRef, NodeToken
from tessera.private_files import check_private

log = logging.getLogger(__name__)
AUTH_HEADER = "X-Tessera-Auth"
SECRET_BYTES = 32
MAX_NONCES = 1 << 20  # bounds the replay cache's memory whatever the request rate
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --- the secret file ---------------------------------------------------------------------


def create_secret(path: Path) -> bytes:
    """Write a new random secret (hex) readable by this user only; returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_hex(SECRET_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)  # O_CREAT's mode does not apply to an existing file
    return secret.encode()


@functools.lru_cache(maxsize=8)
def read_secret(path: str) -> bytes:
    """The secret in ``path``; refuses a missing, short or group/world-readable file."""
    p = Path(path)
    try:
        text = p.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"security.secret_file = {path!r} cannot be read ({exc}); `tessera up` creates one, "
                          "or run `python -c 'import secrets; print(secrets.token_hex(32))' > FILE; "
                          "chmod 600 FILE`") from None
    check_private(p, "security.secret_file")
    if len(text) < 32:
        raise ConfigError(f"security.secret_file = {path!r} holds {len(text)} characters; expected at least 32 "
                          "(64 hex digits from secrets.token_hex(32))")
    return text.encode()


# --- signing and verifying internal requests ---------------------------------------------


def _message(method: str, path: str, ts: str, nonce: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((method.upper(), path, ts, nonce, digest)).encode()


def sign(secret: bytes, method: str, path: str, body: bytes = b"", *, now: float | None = None,
         nonce: str | None = None) -> str:
    """The ``X-Tessera-Auth`` value for one request (``path``: raw path and query)."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(12)
    sig = hmac.new(secret, _message(method, path, ts, nonce, body), hashlib.sha256).hexdigest()
    return f"ts={ts},nonce={nonce},sig={sig}"


class Unauthorized(Exception):
    """An internal request without a valid signature (HTTP 401)."""


@dataclass
class Verifier:
    """Checks signatures; remembers nonces for the skew window so that none is accepted twice."""

    secret: bytes
    max_skew_s: float = 30.0
    clock: Callable[[], float] = time.time
    _seen: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def verify(self, method: str, path: str, header: str | None, body: bytes) -> None:
        if not header:
            raise Unauthorized(f"missing {AUTH_HEADER}: the internal plane serves the cluster's own processes only")
        try:
            parts = dict(item.split("=", 1) for item in header.split(","))
            ts, nonce, sig = parts["ts"], parts["nonce"], parts["sig"]
            age = self.clock() - int(ts)
        except (KeyError, ValueError):
            raise Unauthorized(f"malformed {AUTH_HEADER}") from None
        if abs(age) > self.max_skew_s:
            raise Unauthorized(f"signature timestamp is {age:.0f}s off this node's clock "
                               f"(at most {self.max_skew_s:.0f}s allowed)")
        want = hmac.new(self.secret, _message(method, path, ts, nonce, body), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            raise Unauthorized("bad signature: this process does not hold the cluster secret")
        now = self.clock()
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= MAX_NONCES):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise Unauthorized("replayed request (nonce already used)")
        self._seen[nonce] = now + 2 * self.max_skew_s


def internal_middleware(verifier: Verifier | None, open_paths: Iterable[str] = ("/health",)
                        ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Refuse (401) every request but ``open_paths`` without a valid signature, before its handler."""
    exempt = frozenset(open_paths)

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if verifier is not None and request.path not in exempt:
            try:
                verifier.verify(request.method, request.raw_path, request.headers.get(AUTH_HEADER),
                                await request.read())
            except Unauthorized as exc:
                return web.json_response({"error": str(exc)}, status=401)
        return await handler(request)

    return authenticate


# --- one process's credentials -------------------------------------------------------------


@dataclass(frozen=True)
class ClusterAuth:
    """What a process of the cluster holds: the secret (None: unauthenticated) and TLS settings."""

    secret: bytes | None = None
    security: SecurityConfig = field(default_factory=SecurityConfig)

    @classmethod
    def from_config(cls, config: ClusterConfig) -> ClusterAuth:
        sec = config.security
        return cls(read_secret(sec.secret_file) if sec.secret_file else None, sec)

    def headers(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """Headers that authenticate one request to ``url`` (none without a secret)."""
        if self.secret is None:
            return {}
        return {AUTH_HEADER: sign(self.secret, method, URL(url).raw_path_qs, body)}

    def client_middleware(self) -> Callable[..., Awaitable[Any]]:
        """An aiohttp *client* middleware that signs every request of a session."""

        async def sign_request(request: aiohttp.ClientRequest, handler: Callable[..., Awaitable[Any]]) -> Any:
            body = request.body
            raw = bytes(body) if isinstance(body, bytes | bytearray) else await body.as_bytes()
            request.headers.update(self.headers(request.method, str(request.url), raw))
            return await handler(request)

        return sign_request

    def verifier(self) -> Verifier | None:
        return None if self.secret is None else Verifier(self.secret, self.security.max_clock_skew_s)

    def middleware(self, open_paths: Iterable[str] = ("/health",)) -> Callable[..., Awaitable[web.StreamResponse]]:
        return internal_middleware(self.verifier(), open_paths)

    def server_ssl(self) -> ssl.SSLContext | None:
        """TLS context of every HTTP listener, or None without ``security.tls_cert_file``."""
        if not self.security.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.security.tls_cert_file, self.security.tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"security.tls_cert_file / tls_key_file cannot be loaded: {exc}") from None
        return ctx

    def client_ssl(self) -> ssl.SSLContext | bool:
        """What aiohttp clients pass as ``ssl=`` toward the cluster's own listeners."""
        if not self.security.tls:
            return True
        return client_context(self.security.tls_ca_file or self.security.tls_cert_file)


@functools.lru_cache(maxsize=8)
def client_context(cafile: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"security.tls_ca_file = {cafile!r} cannot be loaded: {exc}") from None


def capability(secret: bytes, op: str, node: str, slots: Iterable[int], epoch: int, expires: int) -> bytes:
    """Token that lets its holder ``op`` ("read"/"write") exactly ``slots`` of ``node`` until ``expires``.

    ``expires`` is unix seconds (the cluster's clocks agree within ``max_clock_skew_s``);
    ``epoch`` ties the token to one storage epoch of one unit.
    """
    text = f"tessera-capability\n{op}\n{node}\n{epoch}\n{expires}\n" + ",".join(map(str, slots))
    return hmac.new(secret, text.encode(), hashlib.sha256).digest()


def block_mac_key(secret: bytes) -> bytes:
    """Key of the block headers' MAC (derived: one key per use of the secret)."""
    return hmac.new(secret, b"tessera-block-mac", hashlib.sha256).digest()


class CapabilityIssuer:
    """The control plane's side of capabilities: tokens for a grant's or lease's blocks."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.clock = clock

    def issue(self, op: str, blocks: Iterable[BlockRef], epoch: int, ttl_s: float) -> tuple[NodeToken, ...]:
        expires = int(self.clock() + ttl_s) + 1
        by_node: dict[str, list[int]] = {}
        for ref in blocks:
            by_node.setdefault(ref.node, []).append(ref.index)
        return tuple(NodeToken(node, expires, capability(self.secret, op, node, slots, epoch, expires).hex())
                     for node, slots in by_node.items())

"""The cluster secret and what it authenticates: internal requests, TLS contexts, capabilities.

Every process of one cluster reads the same secret file (``security.secret_file``, 0600,
created by ``tessera up``). Holding it is what makes a process part of the cluster: the
internal plane (``/control/*``, the generation nodes' API, the memory nodes' ``/info``)
refuses any request that does not carry

    X-Tessera-Auth: ts=<unix seconds>,nonce=<hex>,len=<body bytes>,sha256=<hex>,sig=<hex HMAC-SHA256>

where ``sig = HMAC(secret, method \\n raw path \\n host:port \\n ts \\n nonce \\n len \\n sha256)``:
``host:port`` is the listener the request is for (as the config names it), ``len`` and
``sha256`` describe the body. A request older or newer than ``security.max_clock_skew_s`` is
refused, and so is a nonce seen within that window (a captured request cannot be replayed at
its own listener, nor used at any other), and a request signed before the listener's process
started (its nonce cache is new: :data:`RESTART_GRACE_S`). Refusal is a 401 from a middleware that runs
before any handler, so no state is touched, and it is decided from the head alone: the body
is read only after the signature verified, and must then hash to the signed ``sha256``.

Capabilities (:func:`capability`) are HMACs of the same secret over what a data-plane
request may touch; the memory node checks them (see :mod:`tessera.transport.tcp_server`).

Only the standard library's ``hmac``, ``hashlib``, ``secrets`` and ``ssl`` are used.
"""

from __future__ import annotations

import asyncio
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
from tessera.http import MAX_BODY
from tessera.messages.common import BlockRef
from tessera.messages.plan import NodeToken
from tessera.private_files import check_private

log = logging.getLogger(__name__)
AUTH_HEADER = "X-Tessera-Auth"
SECRET_BYTES = 32
MAX_NONCES = 1 << 20  # bounds the replay cache's memory whatever the request rate
RESTART_GRACE_S = 2.0  # a signature this much older than its listener's start is still taken
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


def audience(url: str) -> str:
    """The listener a request to ``url`` is for: its ``host:port`` as the cluster config names it.

    The config refuses two listeners on one address, so within a cluster the address names
    exactly one role and node; every role dials the others at their configured ``host:port``.
    """
    u = URL(url)
    return f"{u.host}:{u.port}"


def _message(method: str, path: str, to: str, ts: str, nonce: str, length: int, digest: str) -> bytes:
    return "\n".join((method.upper(), path, to, ts, nonce, str(length), digest)).encode()


def sign(secret: bytes, method: str, path: str, body: bytes = b"", *, to: str = "", now: float | None = None,
         nonce: str | None = None) -> str:
    """The ``X-Tessera-Auth`` value for one request (``path``: raw path and query; ``to``: :func:`audience`)."""
    ts = str(int(time.time() if now is None else now))
    nonce = nonce or secrets.token_hex(12)
    digest = hashlib.sha256(body).hexdigest()
    sig = hmac.new(secret, _message(method, path, to, ts, nonce, len(body), digest), hashlib.sha256).hexdigest()
    return f"ts={ts},nonce={nonce},len={len(body)},sha256={digest},sig={sig}"


class Unauthorized(Exception):
    """An internal request without a valid signature (HTTP 401)."""


@dataclass(frozen=True)
class SignedHead:
    """A request head whose signature verified; its body must still hash to ``digest``."""

    length: int
    digest: str

    def check_body(self, body: bytes) -> None:
        if len(body) != self.length or not hmac.compare_digest(hashlib.sha256(body).hexdigest(), self.digest):
            raise Unauthorized("bad signature: the body is not the one that was signed")


@dataclass
class Verifier:
    """Checks signatures; remembers nonces for the skew window so that none is accepted twice.

    ``audience`` is this listener's ``host:port`` (:func:`audience`): a request signed for
    another listener is refused, so one captured on its way to one node is no good at any
    other. The head (method, path, listener, time, nonce, body length and hash) is checked
    before the body is read (:meth:`check_head`); the body then has to match the signed hash.
    """

    secret: bytes
    max_skew_s: float = 30.0
    clock: Callable[[], float] = time.time
    audience: str = ""
    _seen: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # when this listener's process began verifying: its nonce cache is empty, so a request
    # signed earlier is refused, or a captured request could be replayed once at a restarted
    # node within the skew window. RESTART_GRACE_S covers whole-second timestamps and skew.
    started: float | None = None  # None: the clock's reading at construction

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def check_head(self, method: str, path: str, header: str | None, content_length: int) -> SignedHead:
        """Verify the signature over the head and the *declared* body; the nonce is spent."""
        if not header:
            raise Unauthorized(f"missing {AUTH_HEADER}: the internal plane serves the cluster's own processes only")
        try:
            parts = dict(item.split("=", 1) for item in header.split(","))
            ts, nonce, sig, digest = parts["ts"], parts["nonce"], parts["sig"], parts["sha256"]
            length = int(parts["len"])
            age = self.clock() - int(ts)
        except (KeyError, ValueError):
            raise Unauthorized(f"malformed {AUTH_HEADER}") from None
        if abs(age) > self.max_skew_s:
            raise Unauthorized(f"signature timestamp is {age:.0f}s off this node's clock "
                               f"(at most {self.max_skew_s:.0f}s allowed)")
        message = _message(method, path, self.audience, ts, nonce, length, digest)
        want = hmac.new(self.secret, message, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, sig):
            raise Unauthorized("bad signature: this process does not hold the cluster secret, "
                               "or the request was signed for another listener")
        assert self.started is not None
        if int(ts) < self.started - RESTART_GRACE_S:
            raise Unauthorized(f"signed {self.started - int(ts):.0f}s before this listener started: a replay "
                               f"across its restart, or clocks {RESTART_GRACE_S:g}s or more apart (sync them)")
        if length != content_length:
            raise Unauthorized(f"Content-Length {content_length} is not the signed body length {length}")
        now = self.clock()
        while self._seen and (next(iter(self._seen.values())) < now or len(self._seen) >= MAX_NONCES):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            raise Unauthorized("replayed request (nonce already used)")
        self._seen[nonce] = now + 2 * self.max_skew_s
        return SignedHead(length, digest)

    def verify(self, method: str, path: str, header: str | None, body: bytes) -> None:
        """Head and body at once (the body already in hand)."""
        self.check_head(method, path, header, len(body)).check_body(body)


def internal_middleware(verifier: Verifier | None, open_paths: Iterable[str] = ("/health",), *, body_timeout_s: float,
                        max_body: int = MAX_BODY) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Refuse every request but ``open_paths`` without a valid signature, before its handler.

    Everything but the body hash is checked from the head alone, before a byte of the body is
    read: a request without the secret costs the node a parsed head, never a buffered body.
    Bodies must be framed by ``Content-Length`` (chunked ones are refused with 411, longer
    than ``max_body`` with 413), must arrive within ``body_timeout_s`` (408) and must hash to
    what was signed (401).
    """
    exempt = frozenset(open_paths)

    def refuse(status: int, message: str) -> web.Response:
        resp = web.json_response({"error": message}, status=status)
        resp.force_close()  # the unread body, if any, is not worth reading
        return resp

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if verifier is None or request.path in exempt:
            return await handler(request)
        if "Transfer-Encoding" in request.headers:
            return refuse(411, "the internal plane takes bodies with a Content-Length only (no chunked encoding)")
        length = request.content_length or 0
        if length > max_body:
            return refuse(413, f"body of {length} B; the internal plane takes at most {max_body} B")
        try:
            head = verifier.check_head(request.method, request.raw_path, request.headers.get(AUTH_HEADER), length)
        except Unauthorized as exc:
            return refuse(401, str(exc))
        try:
            async with asyncio.timeout(body_timeout_s):
                body = await request.read()
        except TimeoutError:
            return refuse(408, f"the body did not arrive within {body_timeout_s:.0f}s")
        try:
            head.check_body(body)
        except Unauthorized as exc:
            return refuse(401, str(exc))
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
        return {AUTH_HEADER: sign(self.secret, method, URL(url).raw_path_qs, body, to=audience(url))}

    def client_middleware(self) -> Callable[..., Awaitable[Any]]:
        """An aiohttp *client* middleware that signs every request of a session."""

        async def sign_request(request: aiohttp.ClientRequest, handler: Callable[..., Awaitable[Any]]) -> Any:
            body = request.body
            raw = bytes(body) if isinstance(body, bytes | bytearray) else await body.as_bytes()
            request.headers.update(self.headers(request.method, str(request.url), raw))
            return await handler(request)

        return sign_request

    def verifier(self, host: str, port: int) -> Verifier | None:
        """The verifier of the listener on ``host:port`` (None without a secret)."""
        if self.secret is None:
            return None
        return Verifier(self.secret, self.security.max_clock_skew_s,
                        audience=audience(str(URL.build(scheme="http", host=host, port=port))))

    def middleware(self, host: str, port: int, *, body_timeout_s: float,
                   open_paths: Iterable[str] = ("/health",)) -> Callable[..., Awaitable[web.StreamResponse]]:
        """The internal plane's middleware for the listener on ``host:port``, as the config names it."""
        return internal_middleware(self.verifier(host, port), open_paths, body_timeout_s=body_timeout_s)

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


def term_notice(secret: bytes, node: str, boot_id: str, term: int) -> str:
    """MAC of a control plane telling memory node ``node`` (this boot) that its leader term is ``term``."""
    return hmac.new(secret, f"tessera-term\n{node}\n{boot_id}\n{term}".encode(), hashlib.sha256).hexdigest()


def plan_seal(secret: bytes, node: str, term: int, request_id: str) -> str:
    """MAC of the leader of ``term`` on its plan for ``request_id`` on generation node ``node``.

    A generation node runs a plan, and takes its term as the newest, only with this proof
    (:mod:`tessera.generation.terms`): a control plane without the secret cannot raise a
    node's term, and a plan sealed for one node or request is no good for another. It does
    not cover the plan's units: their shared blocks carry capabilities of their own.
    """
    return hmac.new(secret, f"tessera-plan\n{node}\n{term}\n{request_id}".encode(), hashlib.sha256).hexdigest()


def capability(secret: bytes, op: str, node: str, holder: str, slots: Iterable[int], epoch: int,
               expires: int) -> bytes:
    """Token that lets ``holder`` ``op`` ("read"/"write") exactly ``slots`` of ``node`` until ``expires``.

    ``holder`` is the generation node it is issued to: the memory node accepts the token only
    on a data connection authenticated as that node (:mod:`tessera.transport.handshake`), so a
    sniffed or replayed token is useless on any other connection. ``expires`` is unix seconds
    (the cluster's clocks agree within ``max_clock_skew_s``); ``epoch`` ties the token to one
    storage epoch of one unit.
    """
    text = f"tessera-capability\n{op}\n{node}\n{holder}\n{epoch}\n{expires}\n" + ",".join(map(str, slots))
    return hmac.new(secret, text.encode(), hashlib.sha256).digest()


def block_mac_key(secret: bytes) -> bytes:
    """Key of the block headers' MAC (derived: one key per use of the secret)."""
    return hmac.new(secret, b"tessera-block-mac", hashlib.sha256).digest()


class CapabilityIssuer:
    """The control plane's side of capabilities: tokens for a grant's or lease's blocks."""

    def __init__(self, secret: bytes, clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.clock = clock

    def issue(self, op: str, blocks: Iterable[BlockRef], epoch: int, ttl_s: float, *,
              holder: str) -> tuple[NodeToken, ...]:
        """Tokens for ``holder`` (the generation node that will move the blocks), one per memory node."""
        expires = int(self.clock() + ttl_s) + 1
        by_node: dict[str, list[int]] = {}
        for ref in blocks:
            by_node.setdefault(ref.node, []).append(ref.index)
        return tuple(NodeToken(node, expires, capability(self.secret, op, node, holder, slots, epoch, expires).hex(),
                               holder) for node, slots in by_node.items())

"""Tenants of the public API: who an API key is, which scopes it may use, whether it is admin.

Keys are read from ``security.keys_file`` (TOML, or JSON when the name ends in ``.json``)::

    [[tenants]]
    name = "acme"
    scopes = ["docs", "support/*"]     # exact scope names, or prefixes ending in "*"; "*" = any
    keys_sha256 = ["<sha256 hex of the key>"]   # or keys = ["plain key"] (hashed on load)
    admin = false                      # admin keys may read /metrics

The file must be readable by its owner only (``chmod 600``), like the cluster secret: one
that group or others may read is refused at start-up.

A request names its key OpenAI-style (``Authorization: Bearer KEY``): a missing or unknown
key is a 401, a scope the tenant does not own a 403 whose message names only the scope the
request asked for (never another tenant's). The tenant's name is part of every unit's
identity (:func:`tessera.units.unit_id_for`), hence of every index, directory and cache key:
no tenant can hit, or learn anything from, another tenant's units.

With no keys file every request is the :data:`OPEN` tenant (name ``""``: ids as without
tenants), which the retrieval role allows on a loopback interface only.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from tessera.errors import BadRequest, ConfigError
from tessera.private_files import check_private
from tessera.units import in_scopes

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    scopes: tuple[str, ...]
    admin: bool = False

    def allows(self, scope: str) -> bool:
        return in_scopes(scope, self.scopes)

    def check_scope(self, scope: str, where: str = "scope") -> None:
        """403 unless this tenant owns ``scope``; the message names nothing but that scope."""
        if not self.allows(scope):
            raise BadRequest(f"{where} = {scope!r}: this API key may not use that scope", 403)


OPEN = Tenant("", ("*",), admin=True)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """API key digest -> tenant. Verb: ``authenticate(authorization header) -> Tenant``."""

    def __init__(self, tenants: Mapping[str, Tenant]) -> None:
        self._by_digest = dict(tenants)

    def __len__(self) -> int:
        return len(self._by_digest)

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        p = Path(path)
        try:
            text = p.read_text()
            raw: Any = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"security.keys_file = {str(p)!r} cannot be read: {exc}") from None
        check_private(p, "security.keys_file")  # like the secret: keys (or their digests) are credentials
        entries = raw.get("tenants") if isinstance(raw, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ConfigError(f"{p}: expected a non-empty list of [[tenants]] with name, scopes and keys_sha256")
        out: dict[str, Tenant] = {}
        for i, e in enumerate(entries):
            where = f"{p}: tenants[{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not e["name"]:
                raise ConfigError(f"{where}: expected a table with a non-empty name")
            scopes = e.get("scopes", [])
            if not isinstance(scopes, list) or not all(isinstance(s, str) and s for s in scopes):
                raise ConfigError(f"{where}.scopes: expected a list of scope names or prefixes ending in *")
            digests = [str(d).lower() for d in e.get("keys_sha256", [])] + [_digest(k) for k in e.get("keys", [])]
            if not digests or not all(len(d) == 64 for d in digests):
                raise ConfigError(f"{where}: expected keys_sha256 (64 hex digits each) or keys")
            tenant = Tenant(e["name"], tuple(scopes), bool(e.get("admin", False)))
            for d in digests:
                if d in out and out[d] != tenant:
                    raise ConfigError(f"{where}: a key is listed for two tenants")
                out[d] = tenant
        return cls(out)

    def authenticate(self, authorization: str | None) -> Tenant:
        if not authorization or not authorization.startswith("Bearer ") or not authorization[7:].strip():
            raise BadRequest("missing API key: send the header Authorization: Bearer <key>", 401)
        digest = _digest(authorization[7:].strip())
        # compare every digest (constant time per key): the loop's length does not depend on the key
        found = [t for d, t in self._by_digest.items() if hmac.compare_digest(d, digest)]
        if not found:
            raise BadRequest("unknown API key", 401)
        return found[0]


# request[TENANT]: the tenant the public middleware authenticated (a typed key: a plain string
# key made aiohttp warn NotAppKeyWarning on every authenticated request)
TENANT = web.RequestKey("tessera_tenant", Tenant)


def tenant_of(request: web.Request) -> Tenant:
    tenant = request.get(TENANT)
    assert isinstance(tenant, Tenant), "the public middleware did not run"
    return tenant


def _refuse(request: web.Request, message: str, status: int) -> web.Response:
    if request.path.startswith("/v1/chat"):  # the OpenAI-compatible API keeps OpenAI's error shape
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
        body: Any = {"error": {"message": message, "type": kind, "code": status}}
    else:
        body = {"error": message}
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _unread(request: web.Request, refused: web.Response) -> web.Response:
    """A refusal sent before the body was read closes the connection: the unread body is not
    worth reading, and the connection stays open for as long as its sender likes otherwise."""
    if request.body_exists:
        refused.force_close()
    return refused


def public_middleware(keys: KeyRing | None, open_paths: tuple[str, ...] = ("/health",),
                      admin_paths: tuple[str, ...] = ("/metrics",), *, body_timeout_s: float = 30.0,
                      ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Authenticate every public request but ``open_paths``; ``admin_paths`` need an admin key.

    An authenticated request's body must then arrive within ``body_timeout_s`` (408), or a
    client that trickles its body would hold a handler and its admission slot for as long as
    it liked. The body is read here, once; handlers get it cached.
    """

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        try:
            tenant = OPEN if keys is None else keys.authenticate(request.headers.get("Authorization"))
        except BadRequest as exc:
            return _unread(request, _refuse(request, str(exc), exc.status))
        if request.path in admin_paths and not tenant.admin:
            return _unread(request, _refuse(request, f"{request.path} needs an admin API key", 403))
        request[TENANT] = tenant
        if request.body_exists:
            try:
                async with asyncio.timeout(body_timeout_s):
                    await request.read()
            except TimeoutError:
                refused = _refuse(request, f"the request body did not arrive within {body_timeout_s:g}s "
                                           "(listener.body_timeout_s)", 408)
                refused.force_close()  # the rest of a trickled body is not worth reading
                return refused
        return await handler(request)

    return authenticate


def admin_middleware(keys: KeyRing | None, paths: tuple[str, ...] = ("/metrics",)
                     ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """On an internal listener: ``paths`` (Prometheus' ``/metrics``) need the admin API key that the
    retrieval role's ``/metrics`` takes, so one scrape config reads every role. No keys: open, as
    the public API is (the caller binds such a listener to loopback only)."""

    @web.middleware
    async def admin_only(request: web.Request, handler: Handler) -> web.StreamResponse:
        if keys is not None and request.path in paths:
            try:
                tenant = keys.authenticate(request.headers.get("Authorization"))
            except BadRequest as exc:
                return _refuse(request, str(exc), exc.status)
            if not tenant.admin:
                return _refuse(request, f"{request.path} needs an admin API key", 403)
        return await handler(request)

    return admin_only

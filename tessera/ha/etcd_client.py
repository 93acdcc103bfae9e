"""An etcd client with the credentials ``[ha]`` names: TLS (CA, client certificate) and an etcd user.

* **TLS** when ``ha.etcd_ca_file`` is set: etcd's certificate must be signed by that CA and name
  the host of ``ha.etcd``; with ``ha.etcd_cert_file``/``etcd_key_file`` this client presents its
  own certificate (an etcd run with ``--client-cert-auth`` refuses clients without one).
* **An etcd user** when ``ha.etcd_user`` is set (etcd's auth enabled): its password is read from
  ``ha.etcd_password_file`` or, when that is empty, ``$TESSERA_ETCD_PASSWORD``; never from the
  config, never logged. etcd answers the password with a token that it forgets after its
  ``--auth-token-ttl`` without use; the election's loops close the client when etcd says
  "invalid auth token" (:func:`expired_token`), and the next call authenticates again.

Files given to Tessera that hold a secret (the key, the password) must be readable by their
owner only (:func:`~tessera.private_files.check_private`). Everything is read when the client is
made, so a missing file fails at once with the config key that names it.

This module knows nothing about elections.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import grpc
from aetcd import rpc, watcher

from tessera.config import HAConfig
from tessera.errors import ConfigError
from tessera.private_files import check_private

PASSWORD_ENV = "TESSERA_ETCD_PASSWORD"


def _read(path: str, setting: str, *, secret: bool) -> bytes:
    if secret:
        check_private(Path(path).expanduser(), setting)
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting} = {path!r} cannot be read ({exc})") from None


def etcd_password(ha: HAConfig) -> str | None:
    """The password of ``ha.etcd_user`` (None without a user)."""
    if not ha.etcd_user:
        return None
    if ha.etcd_password_file:
        password = _read(ha.etcd_password_file, "ha.etcd_password_file", secret=True).decode().strip()
    else:
        password = os.environ.get(PASSWORD_ENV, "")
    if not password:
        raise ConfigError(f"ha.etcd_user = {ha.etcd_user!r} has no password: put it in a file of mode 0600 named by "
                          f"ha.etcd_password_file, or in ${PASSWORD_ENV}")
    return password


def tls_credentials(ha: HAConfig) -> grpc.ChannelCredentials | None:
    """grpc's TLS credentials for ``ha`` (None: plaintext)."""
    if not ha.etcd_tls:
        return None
    ca = _read(ha.etcd_ca_file, "ha.etcd_ca_file", secret=False)
    if not ha.etcd_cert_file:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=_read(ha.etcd_key_file, "ha.etcd_key_file", secret=True),
        certificate_chain=_read(ha.etcd_cert_file, "ha.etcd_cert_file", secret=False))


def connect(ha: HAConfig, timeout_s: float = 5.0) -> aetcd.Client:
    """A client of ``ha.etcd`` (``host:port``) with ``ha``'s credentials; it connects on first use."""
    host, _, port = ha.etcd.rpartition(":")
    password = etcd_password(ha)
    return _Client(tls_credentials(ha), host=host or "127.0.0.1", port=int(port),
                   username=ha.etcd_user or None, password=password, timeout=max(1, round(timeout_s)))


def expired_token(exc: BaseException) -> bool:
    """etcd refused the client's auth token (it ran out): closing the client makes it authenticate again."""
    return isinstance(exc, aetcd.exceptions.UnauthenticatedError)


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd has no type hints
    """aetcd's client over TLS when given credentials.

    aetcd 1.0's ``connect`` opens only plaintext channels; this one is the same steps (channel,
    authenticate, stubs, watcher) over ``grpc.aio.secure_channel``.
    """

    _is_connecting: bool  # aetcd's own, set in connect()

    def __init__(self, tls: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tls = tls

    async def connect(self) -> None:
        if self._tls is None:
            await super().connect()
            return
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting = True
        try:
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._tls,
                                                   options=list(self._options.items()))
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                            metadata=self.metadata)
            self._connected.set()
        except BaseException as exc:
            if self.channel is not None:  # a refused password or handshake: the next call starts afresh
                await self.channel.close()
            self._init_channel_attrs()
            if isinstance(exc, rpc.AioRpcError):
                aetcd.exceptions._handle_exception(exc)  # raises the ClientError aetcd maps this status to
            raise
        finally:
            self._is_connecting = False

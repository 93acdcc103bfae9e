"""Who is on the other end of a ``tcp`` data connection: the handshake, and the data plane's credentials.

KV blocks encode tenants' text, so a capability must not be a bearer token that anyone who
sniffs it can spend. Every ``tcp`` connection therefore starts with a challenge:

    memory node -> HELLO (magic, boot id, slot size, capacity, 32 B random *nonce*)
    client      -> AUTH  (magic, name length, proof 32 B, name)
    memory node -> RESPONSE ok (req_id 0), or ERROR with the reason, then it closes

``proof = HMAC(secret, "tessera-data-auth" | memory node | boot id | nonce | name)``: the
client proves it holds the cluster secret and names the generation node it speaks for.
The nonce is new on every connection, so a captured handshake proves nothing on another
one. From then on the memory node checks every capability against the name the connection
was authenticated as (:func:`tessera.auth.capability` covers the holder): a read lease or
write grant is usable only on a connection of the node it was issued to. A connection
that skips or forges the handshake is refused before any block is read or written.

With ``security.tls_cert_file`` set, the data port speaks TLS with the same certificate
and CA as the HTTP listeners, so the blocks, capabilities and handshake are not readable
on the wire either. Without TLS a sniffer still sees block bytes in flight (but can no
longer spend what it sniffed): turn TLS on wherever the network is not trusted.

What this does not defend against: every process of a cluster holds the same secret, so a
compromised cluster process can authenticate under any name. The binding stops network
attackers (sniffing, replay, injection into another connection), not a rogue member.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
import struct
from dataclasses import dataclass

from tessera.auth import ClusterAuth

AUTH = struct.Struct("<8sH6x32s")
AUTH_MAGIC = b"TKVAUTH1"
NONCE_BYTES = 32
MAX_NAME_BYTES = 255


@dataclass(frozen=True)
class DataPlaneCredentials:
    """What a client's ``tcp`` transport presents to memory nodes.

    ``name``: the generation node every connection is authenticated as; None: as the holder
    named in each capability (a process that speaks for no single node: tests, the bench).
    ``secret`` None: no proof (only a memory node without a secret accepts that).
    ``ssl``: TLS toward the data ports (None: plaintext).
    """

    secret: bytes | None = None
    name: str | None = None
    ssl: ssl.SSLContext | None = None

    @classmethod
    def of(cls, auth: ClusterAuth, name: str | None) -> DataPlaneCredentials:
        """The credentials of a cluster process (TLS iff the cluster's listeners have it)."""
        ctx = auth.client_ssl()
        return cls(auth.secret, name, ctx if isinstance(ctx, ssl.SSLContext) else None)


def proof(secret: bytes, node: str, boot_id: str, nonce: bytes, name: str) -> bytes:
    """The client's answer to one memory node's challenge ``nonce``, speaking for ``name``."""
    text = f"tessera-data-auth\n{node}\n{boot_id}\n{nonce.hex()}\n{name}".encode()
    return hmac.new(secret, text, hashlib.sha256).digest()


def pack_auth(name: str, mac: bytes) -> bytes:
    raw = name.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"node name {name!r} is {len(raw)} bytes; the data handshake takes at most {MAX_NAME_BYTES}")
    return AUTH.pack(AUTH_MAGIC, len(raw), mac.ljust(32, b"\0")) + raw

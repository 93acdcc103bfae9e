"""A private certificate authority for a local etcd: its CA, etcd's certificate and Tessera's client one.

The etcd that ``tessera up --replicas`` (and the tests) start serves clients and peers over TLS
and accepts only clients that present a certificate of this CA (``--client-cert-auth``): only a
process that can read ``client.key`` may read the election, write it or revoke a lease. The files
are made with the ``openssl`` command (Debian's ``openssl``, which ``ca-certificates`` depends on;
the ``cryptography`` package is not a dependency of Tessera), 0600 in a 0700 folder of the user
running Tessera. The CA's key is deleted once both certificates are signed: nothing more can be
issued in this CA's name, and a folder missing any file is issued afresh (a new CA).

This module knows nothing about etcd's flags.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tessera.private_files import make_private, private_dir

OPENSSL = "openssl"
DAYS = 3650  # a local cluster's folder outlives many restarts; a new folder gets new certificates

# only the extensions named here: not the system openssl.cnf's, which differ between distributions
_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
# clientAuth too: etcd's gateway and its peer port present this certificate as a client
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:{host}
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
"""


@dataclass(frozen=True)
class Certificates:
    """The files of one local CA (``ca.crt``), etcd's key pair and the one client key pair."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def in_folder(cls, folder: Path) -> Certificates:
        return cls(folder / "ca.crt", folder / "etcd.crt", folder / "etcd.key", folder / "client.crt",
                   folder / "client.key")

    def complete(self) -> bool:
        return all(p.is_file() for p in (self.ca, self.server_cert, self.server_key, self.client_cert,
                                         self.client_key))


def openssl_missing() -> str | None:
    return None if shutil.which(OPENSSL) else "openssl is not installed (apt-get install -y openssl)"


def issue(folder: Path, host: str = "127.0.0.1") -> Certificates:
    """The certificates in ``folder`` (0700), made now unless every one of them is there."""
    certs = Certificates.in_folder(private_dir(folder))
    if certs.complete():
        return certs
    config, ca_key = folder / "openssl.cnf", folder / "ca.key"
    config.write_text(_CONFIG.format(host=host))
    try:
        _req(config, "ca", "tessera local etcd CA", ca_key, certs.ca)
        _req(config, "server", "tessera local etcd", certs.server_key, certs.server_cert, ca=(certs.ca, ca_key))
        _req(config, "client", "tessera", certs.client_key, certs.client_cert, ca=(certs.ca, ca_key))
    finally:
        ca_key.unlink(missing_ok=True)
        config.unlink(missing_ok=True)
    for path in (certs.ca, certs.server_cert, certs.server_key, certs.client_cert, certs.client_key):
        make_private(path)
    return certs


def _req(config: Path, extensions: str, name: str, key: Path, cert: Path, ca: tuple[Path, Path] | None = None) -> None:
    """A new P-256 key and its certificate: self-signed (the CA) or signed by ``ca`` (cert, key)."""
    signer = ["-CA", str(ca[0]), "-CAkey", str(ca[1])] if ca else []
    done = subprocess.run(
        [OPENSSL, "req", "-x509", "-config", str(config), "-extensions", extensions, "-newkey", "ec",
         "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", str(DAYS), "-subj", f"/CN={name}",
         *signer, "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"openssl could not make {cert.name} ({done.returncode}): {done.stderr.strip()[-1000:]}"
                           " (OpenSSL 3.0 or later is needed)")

"""A throwaway certificate authority for `yinian up --tls`: a CA and one
certificate for every service on this machine (server and client use, for
localhost, its addresses and the given hosts), written to a folder, keys
readable by the owner only. For local use; production brings its own PKI."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.tls import TlsFiles

VALID_DAYS = 7
_CA_USAGE = x509.KeyUsage(
    digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
    key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
    decipher_only=False,
)  # fmt: skip
# Each service serves with its certificate and shows it when it calls another.
_BOTH_ENDS = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "yinian (throwaway)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def _alt_names(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(["localhost", "127.0.0.1", "::1", socket.gethostname(), *hosts]):
        if not host or host in ("0.0.0.0", "::"):
            continue
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())  # fmt: skip
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)


def make_local_ca(folder: Path, hosts: list[str] = ()) -> TlsFiles:
    """Writes ca.pem, mesh.pem and mesh.key under `folder`; returns them as TlsFiles."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("yinian local CA"))
        .issuer_name(_name("yinian local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("yinian mesh"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_alt_names(list(hosts)), critical=False)
        .add_extension(_BOTH_ENDS, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(str(folder / "mesh.pem"), str(folder / "mesh.key"), str(folder / "ca.pem"))
    Path(files.ca).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(files.cert).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(Path(files.key), key)
    return files

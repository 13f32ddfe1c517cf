"""The mesh's own certificate authority: agent and control APIs off loopback
speak TLS with certificates it issued, and their clients trust that CA and no
other (pinned). Keys are written with their final mode (0600) in one step."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.secretfile import write_private
from common.tomlcheck import wildcard

CA_DAYS = 3650
LEAF_DAYS = 825


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _certificate(subject: x509.Name, issuer: x509.Name, public_key, signing_key, days: int,
                 extensions: list[tuple[x509.ExtensionType, bool]]) -> bytes:
    """A certificate (PEM) valid from five minutes ago (clocks differ) for `days`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signing_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def ensure_ca(directory: Path, mesh: str) -> Pair:
    """The mesh CA in `directory` (ca.pem, ca.key), made on first use."""
    pair = Pair(directory / "ca.pem", directory / "ca.key")
    if pair.cert.exists() and pair.key.exists():
        return pair
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"meshd CA of mesh {mesh}")])
    usage = x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False)
    cert = _certificate(name, name, key.public_key(), key, CA_DAYS,
                        [(x509.BasicConstraints(ca=True, path_length=0), True), (usage, True)])
    write_private(pair.key, _key_pem(key))
    pair.cert.write_bytes(cert)
    return pair


def issue(ca: Pair, common_name: str, names: list[str]) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for a server known by `names` (host names and addresses), signed by `ca`."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = _certificate(name, ca_cert.subject, key.public_key(), ca_key, LEAF_DAYS,
                        [(x509.SubjectAlternativeName([_san(n) for n in dict.fromkeys(names)]), False),
                         (x509.BasicConstraints(ca=False, path_length=None), True),
                         (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)])
    return cert, _key_pem(key)


def ensure_issued(ca: Pair, pair: Pair, common_name: str, names: list[str]) -> Pair:
    """`pair` on disk, issued by `ca` for `names` when it is missing or was issued by another CA."""
    if pair.cert.exists() and pair.key.exists():
        ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
        if x509.load_pem_x509_certificate(pair.cert.read_bytes()).issuer == ca_cert.subject:
            return pair
    cert, key = issue(ca, common_name, names)
    write_private(pair.key, key)
    pair.cert.write_bytes(cert)
    return pair


def local_names(host: str) -> list[str]:
    """What a client on this machine or the LAN may call a server listening on `host` (every address of
    this machine's when it listens on all of them)."""
    names = ["127.0.0.1", "::1", "localhost", socket.gethostname(), socket.getfqdn()]
    if not wildcard(host):
        return [host] + names
    addresses = [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family in (socket.AF_INET, socket.AF_INET6)]
    return names + addresses


def server_context(pair: Pair) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(pair.cert, pair.key)
    return ctx


def client_context(ca_file: Path) -> ssl.SSLContext:
    """Trusts the mesh CA and nothing else: a certificate from any other CA is a refused handshake."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca_file))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx

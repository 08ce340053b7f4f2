"""Certificates for the rig, made with the openssl command line (present on every Debian).

One CA signs the apiserver's serving certificate and every client certificate;
the training-operator's webhook gets its own CA in the layout its cert
rotator expects (PKCS#1 keys, a CA whose SAN is the CA name).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

DAYS = "3650"  # the webhook rotator regenerates anything expiring within 90 days


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _key(path: Path) -> None:
    # -traditional: PKCS#1, which the cert rotator of the training-operator parses.
    _openssl("genrsa", "-traditional", "-out", str(path), "2048")


def make_ca(directory: Path, name: str, cn: str) -> None:
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    if crt.exists() and key.exists():
        return
    _key(key)
    _openssl(
        "req", "-x509", "-new", "-key", str(key), "-out", str(crt), "-days", DAYS, "-subj", f"/CN={cn}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", f"subjectAltName=DNS:{cn}",
    )


def make_cert(
    directory: Path, name: str, ca: str, subject: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
    client: bool = False,
) -> None:
    """A leaf certificate `name.crt`/`name.key` signed by `ca.crt`; subject like `/CN=x/O=y`.

    An existing one is kept unless its subject alternative names differ from those asked for
    (the rig's addresses changed): then it is made again.
    """
    key, crt = directory / f"{name}.key", directory / f"{name}.crt"
    sans = [f"DNS:{d}" for d in dns] + [f"IP:{i}" for i in ips]
    if crt.exists() and key.exists() and _sans(crt) == {s.replace("IP:", "IP Address:") for s in sans}:
        return
    _key(key)
    csr = directory / f"{name}.csr"
    _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", subject)
    ext = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
    ext.append("extendedKeyUsage=" + ("clientAuth" if client else "serverAuth,clientAuth"))
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    with tempfile.NamedTemporaryFile("w", suffix=".cnf", delete=False) as f:
        f.write("\n".join(ext) + "\n")
    try:
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(directory / f"{ca}.crt"), "-CAkey",
            str(directory / f"{ca}.key"), "-CAcreateserial", "-out", str(crt), "-days", DAYS, "-extfile", f.name,
        )
    finally:
        Path(f.name).unlink()
        csr.unlink()


def _sans(crt: Path) -> set[str]:
    out = subprocess.run(
        ["openssl", "x509", "-in", str(crt), "-noout", "-ext", "subjectAltName"], capture_output=True, text=True,
    ).stdout
    lines = out.splitlines()[1:]  # after the "X509v3 Subject Alternative Name:" header
    return {part.strip() for line in lines for part in line.split(",") if part.strip()}


def make_service_account_keys(directory: Path) -> None:
    key, pub = directory / "sa.key", directory / "sa.pub"
    if key.exists() and pub.exists():
        return
    _key(key)
    _openssl("rsa", "-in", str(key), "-pubout", "-out", str(pub))

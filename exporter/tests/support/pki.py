"""A throwaway PKI made with the real openssl: a CA, a server certificate for 127.0.0.1/localhost, and client
certificates (one without SANs, two with a DNS SAN each), all signed by the CA.

Well-formed as Python 3.13's default contexts demand (VERIFY_X509_STRICT): the CA with its key usage, every
certificate with the authority key identifier that names its issuer's key."""

from __future__ import annotations

import subprocess
from pathlib import Path

# name -> the extension file's text (subjectAltName), or "" for none
ISSUED = "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
CERTIFICATES = {
    "server": "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    "client": "",
    "client-allowed": "subjectAltName=DNS:scraper.example,email:sre@example.org\n",
    "client-other": "subjectAltName=DNS:intruder.example\n",
}


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(directory: Path) -> Path:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
            "-subj", "/CN=volprobe test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)  # fmt: skip
    for name, extensions in CERTIFICATES.items():
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
        (directory / f"{name}.ext").write_text(ISSUED + extensions)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip
    return directory

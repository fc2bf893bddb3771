"""A throwaway PKI made with the real openssl: a CA, a server certificate for 127.0.0.1/localhost, and client
certificates (one without SANs, two with a DNS SAN each), all signed by the CA. The extensions are those that
Python 3.13's default client context requires (VERIFY_X509_STRICT): key usages, key identifiers."""

from __future__ import annotations

import subprocess
from pathlib import Path

# What every certificate the CA signs carries, and the CA's own key usage.
LEAF = (
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
)
CA_KEY_USAGE = "keyUsage=critical,keyCertSign,cRLSign"
# name -> its subjectAltName extension, or "" for none
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
            "-subj", "/CN=volprobe test CA", "-addext", CA_KEY_USAGE, cwd=directory)  # fmt: skip
    for name, extensions in CERTIFICATES.items():
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
        (directory / f"{name}.ext").write_text(LEAF + extensions)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=directory)  # fmt: skip
    return directory

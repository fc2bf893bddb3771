"""`--web.config.file` in the exporter-toolkit format node_exporter users already have: TLS, mTLS, basic auth.

Like the exporter toolkit, the file is re-read when it or a certificate, key or client CA file it names changes
(checked at each connection), so renewed certificates apply to the next connection without a restart; a change
that does not validate (a new certificate written before its key, a pair that does not match) is logged and the
previous configuration stays in force until the files are whole again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any

import bcrypt
import yaml

from .config import ConfigError, key_path

log = logging.getLogger(__name__)

CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go (IANA) names of the TLS 1.2 suites Go supports, as OpenSSL names them.
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
    "curve_preferences",
}


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    client_auth_type: str = "NoClientCert"
    users: dict[str, bytes] = field(default_factory=dict)  # name -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # the certificate, key and client CA files read: a change to one reloads


def _mapping(value: Any, key: str, allowed: set[str], problems: list[str]) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{key}: must be a mapping")
        return {}
    for name in value:
        if name not in allowed:
            supported = ", ".join(sorted(allowed))
            problems.append(f"{key_path(key, name)}: unknown or unsupported key (supported: {supported})")
    return value


def _file(base: str, value: Any, key: str, problems: list[str]) -> str | None:
    if not isinstance(value, str) or not value:
        problems.append(f"{key}: must be a file name")
        return None
    path = value if os.path.isabs(value) else os.path.join(base, value)
    if not os.path.isfile(path):
        problems.append(f"{key}: {path} does not exist")
        return None
    return path


def _tls_context(
    data: dict[str, Any], base: str, problems: list[str]
) -> tuple[ssl.SSLContext | None, str, tuple[str, ...]]:
    key = "tls_server_config"
    cert = _file(base, data.get("cert_file"), f"{key}.cert_file", problems) if "cert_file" in data else None
    private = _file(base, data.get("key_file"), f"{key}.key_file", problems) if "key_file" in data else None
    if ("cert_file" in data) != ("key_file" in data):
        problems.append(f"{key}: cert_file and key_file go together")
    auth = data.get("client_auth_type", "NoClientCert")
    if not isinstance(auth, str) or auth not in CLIENT_AUTH_TYPES:
        problems.append(f"{key}.client_auth_type: {auth!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
        auth = "NoClientCert"
    ca = (
        _file(base, data.get("client_ca_file"), f"{key}.client_ca_file", problems) if "client_ca_file" in data else None
    )
    if auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and "client_ca_file" not in data:
        problems.append(f"{key}.client_ca_file: {auth} needs a client CA to verify against")
    versions = []
    for name, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        value = data.get(name, default)
        if not isinstance(value, str) or value not in TLS_VERSIONS:
            problems.append(f"{key}.{name}: {value!r} is not one of {', '.join(TLS_VERSIONS)}")
            value = default
        versions.append(TLS_VERSIONS[value])
    suites = data.get("cipher_suites") or []
    unknown = (
        [s for s in suites if not isinstance(s, str) or s not in CIPHER_SUITES]
        if isinstance(suites, list)
        else ["(not a list)"]
    )
    if unknown:
        problems.append(f"{key}.cipher_suites: unsupported: {', '.join(map(str, unknown))}")
    files = tuple(f for f in (cert, private, ca) if f)
    if problems or cert is None or private is None:
        if not problems and data:
            problems.append(f"{key}: cert_file and key_file are required for TLS")
        return None, auth, files
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version, context.maximum_version = versions
    try:
        context.load_cert_chain(cert, private)
        if ca:
            context.load_verify_locations(ca)
        if suites:
            context.set_ciphers(":".join(CIPHER_SUITES[s] for s in suites))
    except (ssl.SSLError, OSError) as err:
        problems.append(f"{key}: cannot load certificates: {err}")
        return None, auth, files
    context.verify_mode = CLIENT_AUTH_TYPES[auth]
    if auth in ("RequestClientCert", "RequireAnyClientCert") and not ca:
        # Python cannot accept an unverified certificate; without a CA these behave as NoClientCert would
        # for RequestClientCert, and refuse every client for RequireAnyClientCert.
        context.verify_mode = ssl.CERT_NONE if auth == "RequestClientCert" else ssl.CERT_REQUIRED
    return context, auth, files


def parse(document: Any, base: str = ".") -> WebConfig:
    problems: list[str] = []
    top = _mapping(document, "web config", {"tls_server_config", "http_server_config", "basic_auth_users"}, problems)
    tls_data = _mapping(top.get("tls_server_config"), "tls_server_config", _TLS_KEYS, problems)
    context, auth, files = _tls_context(tls_data, base, problems) if tls_data else (None, "NoClientCert", ())
    http = _mapping(top.get("http_server_config"), "http_server_config", {"http2", "headers"}, problems)
    headers = http.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        problems.append("http_server_config.headers: must map header names to strings")
        headers = {}
    users: dict[str, bytes] = {}
    raw_users = top.get("basic_auth_users") or {}
    if not isinstance(raw_users, dict):
        problems.append("basic_auth_users: must map user names to bcrypt hashes")
        raw_users = {}
    for name, hashed in raw_users.items():
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            where = key_path("basic_auth_users", name)
            problems.append(f"{where}: is not a bcrypt hash (htpasswd -nBC 10 \"\" | tr -d ':\\n')")
            continue
        users[str(name)] = hashed.encode()
    if problems:
        raise ConfigError(problems)
    return WebConfig(context, auth, users, {str(k): v for k, v in headers.items()}, files)


def load(path: str) -> WebConfig:
    try:
        with open(path) as f:
            document = yaml.safe_load(f)
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror}"]) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"{path}: not valid YAML: {err}"]) from None
    try:
        return parse(document, os.path.dirname(os.path.abspath(path)))
    except ConfigError as err:
        raise ConfigError([f"{path}: {p}" for p in err.problems]) from None


class WebConfigWatcher:
    """The current web configuration; re-read when the file, or a certificate, key or CA file it names, changes
    (modification time, size, inode: a renewal that renames a new file into place counts too)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._config = WebConfig()
        self._auth_cache: dict[tuple[str, bytes], bool] = {}
        if path:
            self._config = load(path)
            self._stamp = self._files_stamp(self._config)

    def _files_stamp(self, config: WebConfig) -> tuple:
        stamps = []
        for name in (self.path or "", *config.files):
            try:
                st = os.stat(name)
                stamps.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamps.append((name, None))
        return tuple(stamps)

    def current(self) -> WebConfig:
        if not self.path:
            return self._config
        stamp = self._files_stamp(self._config)
        if stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    self._stamp = stamp
                    try:
                        self._config = load(self.path)
                        self._auth_cache.clear()
                        self._stamp = self._files_stamp(self._config)  # it may name other files now
                        log.info("reloaded web config %s and the files it names", self.path)
                    except ConfigError as err:
                        log.error("web config %s not reloaded, keeping the previous one: %s", self.path, err)
        return self._config

    def authorized(self, config: WebConfig, header: str | None) -> bool:
        """Check an Authorization header against basic_auth_users; bcrypt results are cached per password."""
        if not config.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = config.users.get(user)
        if hashed is None:
            bcrypt.checkpw(b"volprobe", b"$2b$10$" + b"." * 53)  # same cost for unknown users: no user probing
            return False
        digest = hashlib.sha256(hashed + b"\0" + password.encode()).digest()
        cache_key = (user, digest)
        cached = self._auth_cache.get(cache_key)
        if cached is None:
            cached = bcrypt.checkpw(password.encode(), hashed)
            if len(self._auth_cache) > 1024:
                self._auth_cache.clear()
            self._auth_cache[cache_key] = cached
        return hmac.compare_digest(b"1" if cached else b"0", b"1")

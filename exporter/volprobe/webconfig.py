"""`--web.config.file` in the exporter-toolkit format, all of it: the same web-config.yml node_exporter reads.

Every key, default and error is exporter-toolkit's (web/tls_config.go, web/handler.go; the tests hold a table of
cases checked against exporter-toolkit itself). Where Python's ssl module cannot do what Go does (a certificate
required but not verified, several curves, TLS below 1.2), the file is refused naming the key: a setting is never
accepted and then ignored.

Like the exporter toolkit, the file is re-read when it or a certificate, key or client CA file it names changes
(checked at each connection), so renewed certificates apply to the next connection without a restart; a change
that does not validate (a new certificate written before its key, a pair that does not match) is logged and the
previous configuration stays in force until the files are whole again.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import ipaddress
import logging
import os
import platform
import re
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import bcrypt
import yaml

from .config import ConfigError, key_path

log = logging.getLogger(__name__)

TLS_KEY = "tls_server_config"
CLIENT_AUTH_TYPES = {
    "NoClientCert": ssl.CERT_NONE,
    # Go asks for a certificate and never checks it; nothing depends on it, so it is not asked for (Python
    # could only ask for one it then verifies).
    "RequestClientCert": ssl.CERT_NONE,
    "RequireAnyClientCert": None,  # required but not verified: Python's ssl cannot
    "RequireClientCert": None,  # exporter-toolkit's old name for RequireAnyClientCert
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERIFYING = ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# Go's tls.CipherSuites(), by their Go (IANA) names. TLS 1.2 suites map to OpenSSL's names; Go ignores the TLS
# 1.3 ones in this list (1.3 suites are not configurable in Go), and so does OpenSSL's cipher string.
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
TLS13_SUITES = {"TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"}
# Go's net/http refuses to serve HTTP/2 over TLS 1.2 unless one of these is allowed.
HTTP2_REQUIRED_SUITES = {"TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}
# Security headers exporter-toolkit lets a config set, with the only values allowed (None: any value).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}
_TLS_FIELDS = {
    "cert",
    "key",
    "client_ca",
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "cipher_suites",
    "curve_preferences",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
    "client_allowed_sans",
}
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_GO_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_UNKNOWN_USER_HASH = b"$2b$10$" + b"." * 53  # a valid bcrypt hash of cost 10 that no password matches
_NULL, _BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float"))


@dataclass(frozen=True)
class RateLimit:
    """golang.org/x/time/rate's limiter as exporter-toolkit sets it up: one token per interval, `burst` at most."""

    interval_s: float
    burst: int


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    client_auth_type: str = "NoClientCert"
    allowed_sans: tuple[str, ...] | None = None  # None: any client the TLS settings let in
    users: dict[str, bytes] = field(default_factory=dict)  # name -> bcrypt hash
    headers: dict[str, str] = field(default_factory=dict)
    http2: bool = True  # validated as Go's server does; volprobe answers in HTTP/1.1 (ALPN) either way
    rate_limit: RateLimit | None = None
    files: tuple[str, ...] = ()  # the certificate, key and client CA files read: a change to one reloads
    stamps: tuple[tuple, ...] = ()  # each file read (the web config too) as it was when read: see file_stamp


# -- strict YAML, decoded as yaml.v2's UnmarshalStrict decodes it -----------------------------------------


class _Decoder:
    """Reads YAML nodes into values the way Go's yaml.v2 fills a struct: unknown and repeated keys are errors,
    a string field takes any scalar's text (`X-XSS-Protection: 1` is "1"), null leaves the zero value."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.read: list[tuple] = []  # file_stamp of each file read, taken on the descriptor it was read from

    def fail(self, key: str, message: str) -> None:
        self.problems.append(f"{key}: {message}")

    def mapping(self, node: yaml.Node | None, key: str, fields: set[str] | None = None) -> dict[str, yaml.Node]:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return {}
        if not isinstance(node, yaml.MappingNode):
            self.fail(key, f"must be a mapping, not {_shown(node)}")
            return {}
        result: dict[str, yaml.Node] = {}
        for name_node, value in node.value:
            name = name_node.value if isinstance(name_node, yaml.ScalarNode) else str(name_node.value)
            where = key_path(key, name)
            if name in result:
                self.fail(where, "set twice")
            elif fields is not None and name not in fields:
                self.fail(where, f"unknown key (known: {', '.join(sorted(fields))})")
            else:
                result[name] = value
        return result

    def string(self, node: yaml.Node | None, key: str) -> str:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return ""
        if not isinstance(node, yaml.ScalarNode):
            self.fail(key, f"must be a string, not {_shown(node)}")
            return ""
        return node.value

    def boolean(self, node: yaml.Node | None, key: str, default: bool) -> bool:
        if node is None:
            return default
        if isinstance(node, yaml.ScalarNode) and node.tag == _NULL:
            return False
        if isinstance(node, yaml.ScalarNode) and node.tag == _BOOL:
            return bool(yaml.SafeLoader.construct_yaml_bool(_CONSTRUCTOR, node))
        self.fail(key, f"must be true or false, not {_shown(node)}")
        return default

    def integer(self, node: yaml.Node | None, key: str) -> int:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return 0
        if isinstance(node, yaml.ScalarNode) and node.tag == _INT:
            return int(yaml.SafeLoader.construct_yaml_int(_CONSTRUCTOR, node))
        if isinstance(node, yaml.ScalarNode) and node.tag == _FLOAT:
            number = yaml.SafeLoader.construct_yaml_float(_CONSTRUCTOR, node)
            if number == int(number):
                return int(number)
        self.fail(key, f"must be a whole number, not {_shown(node)}")
        return 0

    def duration(self, node: yaml.Node | None, key: str) -> float:
        """A Go duration (`1s`, `1m30s`, `250ms`) or a whole number of nanoseconds, as yaml.v2 reads one."""
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return 0.0
        if isinstance(node, yaml.ScalarNode) and node.tag == _INT:
            return self.integer(node, key) * 1e-9
        text = node.value if isinstance(node, yaml.ScalarNode) else ""
        seconds = parse_go_duration(text)
        if seconds is None:
            self.fail(key, f"{text or _shown(node)!r} is not a duration (e.g. 1s, 500ms, 1m)")
            return 0.0
        return seconds

    def strings(self, node: yaml.Node | None, key: str) -> list[str] | None:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            return None
        if not isinstance(node, yaml.SequenceNode):
            self.fail(key, f"must be a list, not {_shown(node)}")
            return None
        return [self.string(item, f"{key}[{i}]") for i, item in enumerate(node.value)]


_CONSTRUCTOR = yaml.SafeLoader("")


def _shown(node: yaml.Node) -> str:
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    return repr(node.value)


def parse_go_duration(text: str) -> float | None:
    """Go's time.ParseDuration, in seconds; None if it would not parse."""
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.removeprefix("+"))
    if body == "0":
        return 0.0
    total, position = 0.0, 0
    for match in _GO_DURATION.finditer(body):
        number = match.group(1)
        if match.start() != position or number in ("", "."):
            return None
        total += float(number) * _GO_UNITS[match.group(2)]
        position = match.end()
    if not body or position != len(body):
        return None
    return sign * total


# -- the format ---------------------------------------------------------------------------------------------


@dataclass
class _TLSSettings:
    cert: str = ""
    key: str = ""
    client_ca: str = ""
    cert_file: str = ""
    key_file: str = ""
    client_auth_type: str = ""
    client_ca_file: str = ""
    cipher_suites: list[str] = field(default_factory=list)
    curve_preferences: list[str] = field(default_factory=list)
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    prefer_server_cipher_suites: bool = True
    client_allowed_sans: list[str] | None = None

    def enabled(self) -> bool:
        """exporter-toolkit's TLSConfig.IsEnabled: any of these set turns TLS on (and then needs a pair)."""
        return any((self.cert, self.key, self.client_ca, self.cert_file, self.key_file, self.client_ca_file)) or bool(
            self.client_auth_type
        )


def _read_tls(d: _Decoder, node: yaml.Node | None, base: str) -> _TLSSettings:
    data = d.mapping(node, TLS_KEY, _TLS_FIELDS)
    s = _TLSSettings()
    for name in ("cert", "key", "client_ca", "cert_file", "key_file", "client_auth_type", "client_ca_file"):
        if name in data:
            setattr(s, name, d.string(data[name], f"{TLS_KEY}.{name}"))
    for name in ("cert_file", "key_file", "client_ca_file"):  # relative to the web config's directory
        value = getattr(s, name)
        if value and not os.path.isabs(value):
            setattr(s, name, os.path.join(base, value))
    for name, choices in (("cipher_suites", {*CIPHER_SUITES, *TLS13_SUITES}), ("curve_preferences", CURVES)):
        values = d.strings(data.get(name), f"{TLS_KEY}.{name}") or []
        unknown = [v for v in values if v not in choices]
        if unknown:
            d.fail(f"{TLS_KEY}.{name}", f"unknown: {', '.join(unknown)} (known: {', '.join(sorted(choices))})")
        setattr(s, name, [v for v in values if v in choices])
    for name in ("min_version", "max_version"):
        if name in data:
            value = d.string(data[name], f"{TLS_KEY}.{name}")
            if value in TLS_VERSIONS:
                setattr(s, name, value)
            else:
                d.fail(f"{TLS_KEY}.{name}", f"{value!r} is not one of {', '.join(TLS_VERSIONS)}")
    s.prefer_server_cipher_suites = d.boolean(
        data.get("prefer_server_cipher_suites"), f"{TLS_KEY}.prefer_server_cipher_suites", True
    )
    s.client_allowed_sans = d.strings(data.get("client_allowed_sans"), f"{TLS_KEY}.client_allowed_sans")
    if s.client_auth_type and s.client_auth_type not in CLIENT_AUTH_TYPES:
        d.fail(f"{TLS_KEY}.client_auth_type", f"{s.client_auth_type!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    return s


def _pem(d: _Decoder, path: str, inline: str, key: str) -> bytes | None:
    """The PEM text of a `*_file` key (which wins, as in exporter-toolkit) or of its inline twin."""
    if not path:
        return inline.encode()
    try:
        with open(path, "rb") as f:
            d.read.append(file_stamp(path, os.fstat(f.fileno())))
            return f.read()
    except OSError as err:
        d.fail(f"{TLS_KEY}.{key}", f"cannot read {path}: {err.strerror}")
        return None


def file_stamp(path: str, st: os.stat_result | None = None) -> tuple:
    """What tells a changed file: modification time, size and inode (a renewal renamed into place counts)."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            return (path, None)
    return (path, st.st_mtime_ns, st.st_size, st.st_ino)


@contextlib.contextmanager
def _in_memory_files(*contents: bytes) -> Iterator[list[str]]:
    """Paths that read as these bytes, without putting a private key on disk: ssl loads pairs from paths only."""
    fds = []
    try:
        for content in contents:
            fd = os.memfd_create("volprobe-web-config", os.MFD_CLOEXEC)
            fds.append(fd)
            os.write(fd, content)
        yield [f"/proc/self/fd/{fd}" for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)


def _python_limits(d: _Decoder, s: _TLSSettings) -> None:
    """What exporter-toolkit accepts and Go honours, but Python's ssl (OpenSSL through it) cannot: refused."""
    auth = s.client_auth_type or "NoClientCert"
    if auth in ("RequireAnyClientCert", "RequireClientCert"):
        d.fail(
            f"{TLS_KEY}.client_auth_type",
            f"{auth} (a certificate required but never verified) cannot be honoured with Python's ssl; "
            "use RequireAndVerifyClientCert with client_ca_file",
        )
    if s.client_allowed_sans is not None and auth not in _VERIFYING:
        d.fail(
            f"{TLS_KEY}.client_allowed_sans",
            f"needs client_auth_type RequireAndVerifyClientCert or VerifyClientCertIfGiven: with {auth} "
            "the client certificate is not verified (or not asked for), so the list could not be enforced",
        )
    if len(s.curve_preferences) > 1:
        d.fail(
            f"{TLS_KEY}.curve_preferences",
            "Python's ssl can restrict key exchange to one curve only; list one of " + ", ".join(s.curve_preferences),
        )
    elif s.curve_preferences and not curve_settable(s.curve_preferences[0]):
        d.fail(
            f"{TLS_KEY}.curve_preferences",
            f"{s.curve_preferences[0]} cannot be set with this Python's ssl (Python {platform.python_version()}, "
            f"{ssl.OPENSSL_VERSION}); list another curve, or run volprobe on a Python whose ssl sets it",
        )
    for name in ("min_version", "max_version"):
        if TLS_VERSIONS[getattr(s, name)] < ssl.TLSVersion.TLSv1_2:
            d.fail(f"{TLS_KEY}.{name}", f"{getattr(s, name)}: OpenSSL 3 does not negotiate TLS below 1.2 here")
    if TLS_VERSIONS[s.min_version] > TLS_VERSIONS[s.max_version]:
        d.fail(f"{TLS_KEY}.min_version", f"{s.min_version} is above max_version {s.max_version}")
    if s.cipher_suites and not any(c in CIPHER_SUITES for c in s.cipher_suites) and s.max_version != "TLS13":
        d.fail(f"{TLS_KEY}.cipher_suites", "only TLS 1.3 names, and max_version below TLS13: no handshake could work")


@functools.cache
def curve_settable(curve: str) -> bool:
    """Whether this interpreter's ssl can restrict key exchange to the curve. Older builds (Debian 12's python3,
    3.11.2) set it through OpenSSL's EC_KEY, which has no X25519: asked of ssl itself, not guessed by version."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ecdh_curve(CURVES[curve])
    except (ssl.SSLError, ValueError):
        return False
    return True


def _context(d: _Decoder, s: _TLSSettings, http2: bool) -> tuple[ssl.SSLContext | None, tuple[str, ...]]:
    files = tuple(f for f in (s.cert_file, s.key_file, s.client_ca_file) if f)
    if not (s.cert_file or s.cert):
        d.fail(f"{TLS_KEY}.cert", "missing one of cert or cert_file")
    if not (s.key_file or s.key):
        d.fail(f"{TLS_KEY}.key", "missing one of key or key_file")
    auth = s.client_auth_type or "NoClientCert"
    if (s.client_ca_file or s.client_ca) and auth == "NoClientCert":
        key = "client_ca_file" if s.client_ca_file else "client_ca"
        d.fail(f"{TLS_KEY}.{key}", "a client CA without client_auth_type (client certificates are not asked for)")
    if http2 and s.cipher_suites and s.min_version != "TLS13" and not HTTP2_REQUIRED_SUITES & set(s.cipher_suites):
        d.fail(
            f"{TLS_KEY}.cipher_suites",
            "HTTP/2 (http_server_config.http2, on by default) needs TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 or "
            "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256 in the list (Go's server refuses to start without one)",
        )
    _python_limits(d, s)
    cert = _pem(d, s.cert_file, s.cert, "cert_file")
    private = _pem(d, s.key_file, s.key, "key_file")
    ca = _pem(d, s.client_ca_file, s.client_ca, "client_ca_file") if (s.client_ca_file or s.client_ca) else b""
    if d.problems or cert is None or private is None or ca is None:
        return None, files
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with _in_memory_files(cert, private) as (cert_path, key_path_):
            context.load_cert_chain(cert_path, key_path_)
    except (ssl.SSLError, OSError) as err:
        d.fail(TLS_KEY, f"cannot load the certificate and its key: {err}")
        return None, files
    context.minimum_version = TLS_VERSIONS[s.min_version]
    context.maximum_version = TLS_VERSIONS[s.max_version]
    tls12 = [CIPHER_SUITES[c] for c in s.cipher_suites if c in CIPHER_SUITES]
    if tls12:
        context.set_ciphers(":".join(tls12))
    elif s.cipher_suites:  # only TLS 1.3 names: Go would then fail every TLS 1.2 handshake
        context.minimum_version = ssl.TLSVersion.TLSv1_3
    if s.curve_preferences:
        context.set_ecdh_curve(CURVES[s.curve_preferences[0]])
    if s.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    context.set_alpn_protocols(["http/1.1"])
    mode = CLIENT_AUTH_TYPES[auth]
    assert mode is not None, "refused by _python_limits"
    context.verify_mode = mode
    if auth in _VERIFYING:
        if ca:
            _load_client_cas(context, ca)
        else:  # as Go does with no ClientCAs: the system's roots
            context.load_default_certs(ssl.Purpose.CLIENT_AUTH)
    return context, files


def _load_client_cas(context: ssl.SSLContext, pem: bytes) -> None:
    """Each certificate in the bundle that parses; like Go's AppendCertsFromPEM, the others are skipped (then
    logged here), and a bundle with none verifies no client."""
    loaded = 0
    for block in _PEM_CERTIFICATE.findall(pem):
        try:
            context.load_verify_locations(cadata=block.decode("ascii", "replace"))
            loaded += 1
        except ssl.SSLError as err:
            log.warning("web config: a client CA certificate does not parse and is skipped: %s", err)
    if not loaded:
        log.error("web config: the client CA has no certificate; every client certificate will be refused")


def _read_headers(d: _Decoder, node: yaml.Node | None) -> dict[str, str]:
    key = "http_server_config.headers"
    headers = {name: d.string(value, key_path(key, name)) for name, value in d.mapping(node, key).items()}
    for name, value in headers.items():
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or not value.isascii():
            # A CR or LF would split the response; a character beyond ASCII would fail every response.
            d.fail(key_path(key, name), "must be printable ASCII (no control characters, no line breaks)")
        elif name not in HEADERS:
            d.fail(key_path(key, name), f"cannot be configured (allowed: {', '.join(HEADERS)})")
        elif HEADERS[name] is not None and value not in HEADERS[name]:
            d.fail(key_path(key, name), f"{value!r} is not one of {', '.join(HEADERS[name])}")
    return headers


def _read_users(d: _Decoder, node: yaml.Node | None) -> dict[str, bytes]:
    users = {}
    for name, value in d.mapping(node, "basic_auth_users").items():
        hashed = d.string(value, key_path("basic_auth_users", name))
        match = _BCRYPT.match(hashed)
        if not match or not 4 <= int(match.group(1)) <= 31:
            d.fail(
                key_path("basic_auth_users", name),
                "is not a bcrypt hash (make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n')",
            )
            continue
        users[name] = hashed.encode()
    return users


def parse(text: str, base: str = ".") -> WebConfig:
    """The web config in `text`; relative file names are taken from `base`. ConfigError lists every problem."""
    d = _Decoder()
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise ConfigError([f"web config: not valid YAML: {err}"]) from None
    top = d.mapping(document, "web config", {TLS_KEY, "http_server_config", "rate_limit", "basic_auth_users"})
    settings = _read_tls(d, top.get(TLS_KEY), base)
    http = d.mapping(top.get("http_server_config"), "http_server_config", {"http2", "headers"})
    http2 = d.boolean(http.get("http2"), "http_server_config.http2", True)
    headers = _read_headers(d, http.get("headers"))
    limit = d.mapping(top.get("rate_limit"), "rate_limit", {"interval", "burst"})
    interval = d.duration(limit.get("interval"), "rate_limit.interval")
    burst = d.integer(limit.get("burst"), "rate_limit.burst")
    users = _read_users(d, top.get("basic_auth_users"))
    context, files = None, ()
    if settings.enabled():
        context, files = _context(d, settings, http2)
    if d.problems:
        raise ConfigError(d.problems)
    tls_node = top.get(TLS_KEY)
    if not settings.enabled() and isinstance(tls_node, yaml.MappingNode) and tls_node.value:
        log.warning("web config: tls_server_config has no certificate, key or client auth type: TLS is off")
    rate_limit = RateLimit(interval, burst) if interval != 0 else None
    if rate_limit and burst <= 0:
        log.warning("web config: rate_limit.burst is %d: every request will be refused with 429", burst)
    return WebConfig(
        tls=context,
        client_auth_type=settings.client_auth_type or "NoClientCert",
        allowed_sans=tuple(settings.client_allowed_sans) if settings.client_allowed_sans is not None else None,
        users=users,
        headers=headers,
        http2=http2,
        rate_limit=rate_limit,
        files=files,
        stamps=tuple(d.read),
    )


def load(path: str) -> WebConfig:
    try:
        with open(path, encoding="utf-8") as f:
            stamp = file_stamp(path, os.fstat(f.fileno()))
            text = f.read()
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror}"]) from None
    except UnicodeDecodeError as err:
        raise ConfigError([f"{path}: not UTF-8 text: {err}"]) from None
    try:
        config = parse(text, os.path.dirname(os.path.abspath(path)))
    except ConfigError as err:
        raise ConfigError([f"{path}: {p}" for p in err.problems]) from None
    config.stamps = (stamp, *config.stamps)
    return config


def certificate_sans(certificate: dict[str, Any]) -> list[str]:
    """A peer certificate's subject alternative names as Go prints them: DNS names, emails, IPs, URIs."""
    names = []
    for kind, value in certificate.get("subjectAltName", ()):
        if kind == "IP Address":
            with contextlib.suppress(ValueError):
                value = str(ipaddress.ip_address(value.strip()))
        if kind in ("DNS", "email", "IP Address", "URI"):
            names.append(value)
    return names


class TokenBucket:
    """golang.org/x/time/rate.Limiter.Allow: a bucket of `burst` tokens, refilled one per interval."""

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit
        self._tokens = float(limit.burst)
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        if self.limit.interval_s < 0:  # rate.Every of a negative interval is rate.Inf: no limit
            return True
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.limit.burst, self._tokens + (now - self._at) / self.limit.interval_s)
            self._at = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False


class WebConfigWatcher:
    """The current web configuration; re-read when the file, or a certificate, key or CA file it names, changes
    (modification time, size, inode: a renewal that renames a new file into place counts too)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._config = WebConfig()
        self._auth_cache: dict[tuple[str, bytes], bool] = {}
        self._bcrypt = threading.Lock()  # one bcrypt at a time, as exporter-toolkit: bad passwords cannot take
        # every core from the probes
        if path:
            self._config = load(path)
            self._stamp = self._config.stamps
        # Exported as volprobe_web_config_last_reload_*: a renewal that does not load (the old certificate
        # serving on until it expires) shows at the next scrape, which checks the files first.
        self.last_reload_successful = True
        self.last_reload_success_time = time.time()  # the load at start-up (or, with no file, the defaults)

    @staticmethod
    def _now(stamps: tuple[tuple, ...]) -> tuple[tuple, ...]:
        return tuple(file_stamp(stamp[0]) for stamp in stamps)

    def current(self) -> WebConfig:
        if not self.path:
            return self._config
        stamp = self._now(self._stamp or ())
        if stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    # What was read, as it was when read: a file replaced during the load reloads again next time.
                    self._stamp = stamp
                    try:
                        self._config = load(self.path)
                        self._auth_cache.clear()
                        self._stamp = self._config.stamps
                        self.last_reload_successful = True
                        self.last_reload_success_time = time.time()
                        log.info("reloaded web config %s and the files it names", self.path)
                    except ConfigError as err:
                        self.last_reload_successful = False
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
        # An unknown user costs a bcrypt as a known one does, and is cached alike: no telling names apart.
        checked = hashed if hashed is not None else _UNKNOWN_USER_HASH
        digest = hashlib.sha256(checked + b"\0" + password.encode()).digest()
        cache_key = (user, digest)
        cached = self._auth_cache.get(cache_key)
        if cached is None:
            with self._bcrypt:
                try:
                    cached = bcrypt.checkpw(password.encode(), checked) and hashed is not None
                except ValueError:  # bcrypt 5 refuses passwords over 72 bytes: a mismatch, not an error
                    cached = False
            if len(self._auth_cache) > 1024:
                self._auth_cache.clear()
            self._auth_cache[cache_key] = cached
        return hmac.compare_digest(b"1" if cached else b"0", b"1")

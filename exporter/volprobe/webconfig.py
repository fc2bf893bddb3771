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
import collections
import contextlib
import functools
import hashlib
import ipaddress
import logging
import math
import os
import platform
import re
import ssl
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import bcrypt
import yaml

from . import schema, yamlfile
from .config import ConfigError
from .schema import key_path, section, setting

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
_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
_BCRYPT = re.compile(r"^\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}$")
_GO_DURATION = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_LONGEST = (2**63 - 1) * 1e-9  # seconds: a time.Duration is an int64 of nanoseconds
_UNKNOWN_USER_HASH = b"$2b$10$" + b"." * 53  # a valid bcrypt hash of cost 10 that no password matches
# Credentials remembered after a bcrypt: good ones (a few scrapers' and people's) and bad ones, apart.
GOOD_CREDENTIALS = 64
BAD_CREDENTIALS = 4096
_NULL, _BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float"))


@dataclass(frozen=True)
class Credential:
    """A user and password from an Authorization header, to be checked against `hashed` by bcrypt."""

    user: str
    password: bytes
    hashed: bytes  # the user's hash, or _UNKNOWN_USER_HASH
    known_user: bool
    digest: bytes  # sha256 of hash, user and password: the cache's key, never the password itself

    @property
    def key(self) -> bytes:
        return self.digest


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
    stamps: tuple[tuple[Any, ...], ...] = ()  # each file read (the web config too) as it was when read: see file_stamp


# -- strict YAML, decoded as yaml.v2's UnmarshalStrict decodes it -----------------------------------------


class _Decoder(schema.Walker):
    """The schema walker on YAML nodes, filling values the way Go's yaml.v2 fills a struct: unknown and repeated
    keys are errors, a string field takes any scalar's text (`X-XSS-Protection: 1` is "1"), null leaves the
    zero value (the node kinds below say what each one's is)."""

    def __init__(self) -> None:
        super().__init__()
        self.read_files: list[tuple[Any, ...]] = []  # file_stamp of each file read, taken on its descriptor

    def mapping(self, value: Any, key: str, allowed: Collection[str] | None) -> dict[str, Any]:
        self.at = key
        if value is None or _null(value):
            return {}
        if not isinstance(value, yaml.MappingNode):
            self.fail(key, f"must be a mapping, not {_shown(value)}")
            return {}
        result: dict[str, yaml.Node] = {}
        for name_node, item in value.value:
            name = name_node.value if isinstance(name_node, yaml.ScalarNode) else str(name_node.value)
            where = key_path(key, name)
            if name in result:
                self.fail(where, "set twice")
            elif allowed is not None and name not in allowed:
                self.fail(where, f"unknown key (known: {', '.join(sorted(allowed))})")
            else:
                result[name] = item
        return result


def _null(node: Any) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL


def _go_string(node: Any) -> str:
    if _null(node):
        return ""
    if not isinstance(node, yaml.ScalarNode):
        raise ValueError(f"must be a string, not {_shown(node)}")
    return str(node.value)


def _go_bool(node: Any) -> bool:
    if _null(node):
        return False
    if isinstance(node, yaml.ScalarNode) and node.tag == _BOOL:
        return bool(yaml.SafeLoader.construct_yaml_bool(_CONSTRUCTOR, node))
    raise ValueError(f"must be true or false, not {_shown(node)}")


def _go_int(node: Any) -> int:
    if _null(node):
        return 0
    if isinstance(node, yaml.ScalarNode) and node.tag == _INT:
        return int(yaml.SafeLoader.construct_yaml_int(_CONSTRUCTOR, node))
    if isinstance(node, yaml.ScalarNode) and node.tag == _FLOAT:
        number = yaml.SafeLoader.construct_yaml_float(_CONSTRUCTOR, node)
        if math.isfinite(number) and number == int(number):
            return int(number)
    raise ValueError(f"must be a whole number, not {_shown(node)}")


def _go_duration(node: Any) -> float:
    """A Go duration (`1s`, `1m30s`, `250ms`) or a whole number of nanoseconds, as yaml.v2 reads one."""
    if _null(node):
        return 0.0
    if isinstance(node, yaml.ScalarNode) and node.tag == _INT:
        return _go_int(node) * 1e-9
    text = node.value if isinstance(node, yaml.ScalarNode) else ""
    seconds = parse_go_duration(text)
    if seconds is None:
        raise ValueError(f"{text or _shown(node)!r} is not a duration (e.g. 1s, 500ms, 1m)")
    return seconds


def _go_strings(node: Any) -> list[str] | None:
    """A list of strings; null: not set (None)."""
    if _null(node):
        return None
    if not isinstance(node, yaml.SequenceNode):
        raise ValueError(f"must be a list, not {_shown(node)}")
    values: list[str] = []
    problems: list[tuple[int | str, str]] = []
    for index, item in enumerate(node.value):
        try:
            values.append(_go_string(item))
        except ValueError as err:
            problems.append((index, str(err)))
    if problems:
        raise schema.Invalid(problems)
    return values


def _go_names(choices: Collection[str], what: str) -> schema.Kind[list[str]]:
    """A list of names from `choices` (Go's names of suites, curves)."""

    def parse(node: Any) -> list[str]:
        values = _go_strings(node) or []
        unknown = [v for v in values if v not in choices]
        if unknown:
            raise ValueError(f"unknown: {', '.join(unknown)} (known: {', '.join(sorted(choices))})")
        return values

    return schema.Kind(f"list of {what}", parse, ([sorted(choices)[0]], []), (["nonesuch"], "x", [[]]))


def _go_choice(choices: Collection[str]) -> schema.Kind[str]:
    """One of `choices`, written as a string."""

    def parse(node: Any) -> str:
        value = _go_string(node)
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return schema.Kind(" \\| ".join(f"`{c}`" for c in choices), parse, tuple(choices), ("nonesuch", []))


GO_STRING = schema.Kind("string", _go_string, ("x", 1), ([], {"a": 1}))
CLIENT_AUTH_TYPE = schema.Kind(" \\| ".join(f"`{c}`" for c in CLIENT_AUTH_TYPES), _go_string, (), ([],))
GO_BOOL = schema.Kind("true \\| false", _go_bool, (True, False), ("x", [], 1))
GO_INT = schema.Kind("integer", _go_int, (0, 10, -1), ("x", 1.5, []))
GO_DURATION = schema.Kind("Go duration", _go_duration, ("1s", "500ms", "1m30s", 0), ("soon", "1d", []))
GO_STRINGS = schema.Kind("list of strings", _go_strings, (["a.example"], []), ("x", [[]]))
NODE = schema.Kind("mapping", lambda node: node, ({},), ())  # read by its own code: headers, users


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
    while match := _GO_DURATION.match(body, position):  # anchored: see units.parse_duration
        number = match.group(1)
        if number in ("", "."):
            return None
        total += float(number) * _GO_UNITS[match.group(2)]
        position = match.end()
    if not body or position != len(body) or total > _GO_LONGEST:
        return None  # Go's "invalid duration", or its overflow of an int64 of nanoseconds
    return sign * total


# -- the format ---------------------------------------------------------------------------------------------


@dataclass
class _TLSSettings:
    cert: str = setting("", GO_STRING, "the server certificate, PEM (or cert_file)")
    key: str = setting("", GO_STRING, "its private key, PEM (or key_file)")
    client_ca: str = setting("", GO_STRING, "CA certificates of clients, PEM (or client_ca_file)")
    cert_file: str = setting("", GO_STRING, "path of the server certificate (relative: to the web config)")
    key_file: str = setting("", GO_STRING, "path of its private key")
    client_auth_type: str = setting(  # checked after: a wrong name still turns TLS on, as in exporter-toolkit
        "", CLIENT_AUTH_TYPE, "empty is NoClientCert; the two Require*ClientCert are refused"
    )
    client_ca_file: str = setting("", GO_STRING, "path of the clients' CA certificates")
    cipher_suites: list[str] = setting(
        [], _go_names({*CIPHER_SUITES, *TLS13_SUITES}, "Go's suite names"), "TLS 1.2 suites allowed"
    )
    curve_preferences: list[str] = setting([], _go_names(CURVES, "curves"), "the one curve of key exchange")
    min_version: str = setting("TLS12", _go_choice(TLS_VERSIONS), "TLS10 and TLS11 are refused")
    max_version: str = setting("TLS13", _go_choice(TLS_VERSIONS), "highest TLS version")
    prefer_server_cipher_suites: bool = setting(True, GO_BOOL, "the server's order of suites wins")
    client_allowed_sans: list[str] | None = setting(
        None, GO_STRINGS, "client certificates must name one of these (needs a verifying client_auth_type)"
    )

    def enabled(self) -> bool:
        """exporter-toolkit's TLSConfig.IsEnabled: any of these set turns TLS on (and then needs a pair)."""
        return any((self.cert, self.key, self.client_ca, self.cert_file, self.key_file, self.client_ca_file)) or bool(
            self.client_auth_type
        )


@dataclass
class _HTTPSettings:
    http2: bool = setting(True, GO_BOOL, "validated as Go's server does; volprobe answers HTTP/1.1 either way")
    headers: Any = setting(None, NODE, "security headers of every response (exporter-toolkit's five)")


@dataclass
class _RateLimitSettings:
    interval: float = setting(0.0, GO_DURATION, "one request per interval, beyond the burst; 0: no limit")
    burst: int = setting(0, GO_INT, "requests allowed at once")


@dataclass
class WebDocument:
    """The web config file, as exporter-toolkit reads it."""

    tls_server_config: _TLSSettings = section(_TLSSettings, "TLS; on when a certificate, key or client auth is set")
    http_server_config: _HTTPSettings = section(_HTTPSettings, "HTTP settings")
    rate_limit: _RateLimitSettings = section(_RateLimitSettings, "requests beyond it are answered 429")
    basic_auth_users: Any = setting(None, NODE, "user name: bcrypt hash of the password")


def _read_tls(d: _Decoder, s: _TLSSettings, base: str) -> None:
    if s.client_auth_type and s.client_auth_type not in CLIENT_AUTH_TYPES:
        d.fail(f"{TLS_KEY}.client_auth_type", f"{s.client_auth_type!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    for name in ("cert_file", "key_file", "client_ca_file"):  # relative to the web config's directory
        value = getattr(s, name)
        if value and not os.path.isabs(value):
            setattr(s, name, os.path.join(base, value))


def _pem(d: _Decoder, path: str, inline: str, key: str) -> bytes | None:
    """The PEM text of a `*_file` key (which wins, as in exporter-toolkit) or of its inline twin."""
    if not path:
        return inline.encode()
    try:
        data, info = yamlfile.read_bytes(path, "a certificate or key")  # not a FIFO, not /dev/zero
    except OSError as err:
        d.fail(f"{TLS_KEY}.{key}", f"cannot read {path}: {err.strerror}")
        return None
    except ValueError as err:  # not a regular file, too large, a NUL in the name
        d.fail(f"{TLS_KEY}.{key}", f"cannot read {path}: {err}")
        return None
    d.read_files.append(file_stamp(path, info))
    return data


def file_stamp(path: str, st: os.stat_result | None = None) -> tuple[Any, ...]:
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
    headers: dict[str, str] = {}
    for name, value in d.mapping(node, key, None).items():
        ok, text = d.value(GO_STRING, value, key_path(key, name))
        headers[name] = text if ok and text is not None else ""
    for name, value in headers.items():
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value) or not value.isascii():
            # A CR or LF would split the response; a character beyond ASCII would fail every response.
            d.fail(key_path(key, name), "must be printable ASCII (no control characters, no line breaks)")
        elif name not in HEADERS:
            d.fail(key_path(key, name), f"cannot be configured (allowed: {', '.join(HEADERS)})")
        elif (allowed := HEADERS[name]) is not None and value not in allowed:
            d.fail(key_path(key, name), f"{value!r} is not one of {', '.join(allowed)}")
    return headers


def _read_users(d: _Decoder, node: yaml.Node | None) -> dict[str, bytes]:
    users = {}
    for name, value in d.mapping(node, "basic_auth_users", None).items():
        ok, hashed = d.value(GO_STRING, value, key_path("basic_auth_users", name))
        if not ok or hashed is None:
            continue
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
    """The web config in `text`; relative file names are taken from `base`. ConfigError lists every problem, and
    nothing else is raised: an exception of a check that did not foresee a value is a problem of the key looked at
    when it escaped."""
    d = _Decoder()
    try:
        return _parse(d, text, base)
    except ConfigError:
        raise
    except Exception as err:  # the boundary: whatever the file holds, the answer is a ConfigError
        d.fail(d.at or "web config", schema.failure(err))
        raise ConfigError(d.problems) from None


def _parse(d: _Decoder, text: str, base: str) -> WebConfig:
    try:
        document = yaml.compose(text, Loader=yamlfile.Loader)
    except yaml.YAMLError as err:
        raise ConfigError([f"web config: {yamlfile.describe(err)}"]) from None
    web = d.build(WebDocument, document, "", named="web config")
    settings = web.tls_server_config
    _read_tls(d, settings, base)
    http2 = web.http_server_config.http2
    headers = _read_headers(d, web.http_server_config.headers)
    interval, burst = web.rate_limit.interval, web.rate_limit.burst
    users = _read_users(d, web.basic_auth_users)
    context: ssl.SSLContext | None = None
    files: tuple[str, ...] = ()
    if settings.enabled():
        context, files = _context(d, settings, http2)
    if d.problems:
        raise ConfigError(d.problems)
    tls_node = d.mapping(document, "web config", None).get(TLS_KEY)
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
        stamps=tuple(d.read_files),
    )


def load(path: str) -> WebConfig:
    """The web config in the file at `path` (yamlfile: bounded size and nesting, UTF-8): ConfigError, naming
    the file, for anything wrong with it."""
    try:
        text, info = yamlfile.read(path)
    except OSError as err:
        raise ConfigError([f"{path}: cannot read: {err.strerror or err}"]) from None
    except ValueError as err:
        raise ConfigError([f"{path}: {err}"]) from None
    stamp = file_stamp(path, info)
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
        self._stamp: tuple[tuple[Any, ...], ...] | None = None
        self._config = WebConfig()
        # Passwords checked, by Credential.key, good and bad apart (see check()). The key holds the user's hash, so
        # a changed or removed user's entries are never found again: a reload need not clear them.
        self._good: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._bad: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._bcrypt = threading.Lock()  # authorized(): one bcrypt at a time (the server has PasswordChecks)
        if path:
            self._config = load(path)
            self._stamp = self._config.stamps
        # Exported as volprobe_web_config_last_reload_*: a renewal that does not load (the old certificate
        # serving on until it expires) shows at the next scrape, which checks the files first.
        self.last_reload_successful = True
        self.last_reload_success_time = time.time()  # the load at start-up (or, with no file, the defaults)

    @staticmethod
    def _now(stamps: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
        return tuple(file_stamp(stamp[0]) for stamp in stamps)

    @property
    def in_force(self) -> WebConfig:
        """The configuration last loaded, without looking at its files."""
        return self._config

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
                        self._stamp = self._config.stamps
                        self.last_reload_successful = True
                        self.last_reload_success_time = time.time()
                        log.info("reloaded web config %s and the files it names", self.path)
                    except ConfigError as err:
                        self.last_reload_successful = False
                        for problem in err.problems:  # a line each, as a refused volprobe.yml's
                            log.error("web config %s not reloaded, keeping the previous one: %s", self.path, problem)
        return self._config

    def verdict(self, config: WebConfig, header: str | None) -> bool | Credential:
        """Whether an Authorization header passes basic_auth_users, when that is known without bcrypt (no users,
        no or malformed header, a password checked before); else the Credential for check()."""
        if not config.users:
            return True
        if not header or header[:6].lower() != "basic ":  # the scheme is case-insensitive (RFC 7617)
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except ValueError:  # not base64 (binascii.Error), a byte beyond ASCII in it, or not UTF-8 behind it
            return False
        hashed = config.users.get(user)
        # An unknown user costs a bcrypt as a known one does, and is cached alike: no telling names apart.
        checked = hashed if hashed is not None else _UNKNOWN_USER_HASH
        # The cache's key: a digest of all three, whatever their length (a user name is the client's to choose).
        digest = hashlib.sha256(b"\0".join((checked, user.encode(), password.encode()))).digest()
        credential = Credential(user, password.encode(), checked, hashed is not None, digest)
        with self._cache_lock:
            if credential.key in self._good:
                self._good.move_to_end(credential.key)
                return True
            if credential.key in self._bad:
                return False
        return credential

    def check(self, credential: Credential) -> bool:
        """bcrypt the credential, and remember the result: good ones and bad ones apart, each bounded, the least
        recently used going first, so that no number of wrong passwords evicts a good one."""
        try:
            good = bcrypt.checkpw(credential.password, credential.hashed) and credential.known_user
        except ValueError:  # bcrypt 5 refuses passwords over 72 bytes: a mismatch, not an error
            good = False
        with self._cache_lock:
            cache, bound = (self._good, GOOD_CREDENTIALS) if good else (self._bad, BAD_CREDENTIALS)
            cache[credential.key] = None
            while len(cache) > bound:
                cache.popitem(last=False)
        return good

    def authorized(self, config: WebConfig, header: str | None) -> bool:
        """Check an Authorization header against basic_auth_users; bcrypt results are cached per password."""
        verdict = self.verdict(config, header)
        if isinstance(verdict, bool):
            return verdict
        with self._bcrypt:
            return self.check(verdict)

# ruff: noqa: E501 - one case per line reads best as a table
"""The exporter-toolkit web configuration format, case by case (issue 17).

Each case states what exporter-toolkit decides (web.Validate, or its listener refusing to start), and the
test asks exporter-toolkit itself (webconfig_oracle, built from the module proxy) to confirm it; volprobe
must decide the same, naming the key when it rejects, or refuse clearly, naming the key, what it could not
honour (`refuse`: Python's ssl cannot, or the setting would be silently ignored).

Rules taken from exporter-toolkit:
- strict YAML: unknown keys and wrong types are errors;
- TLS is on when any of cert, cert_file, key, key_file, client_ca, client_ca_file, client_auth_type is set;
  then one of cert/cert_file and one of key/key_file is required, and the pair must load;
- a client CA without a client_auth_type (NoClientCert) is an error; client_auth_type RequireAndVerifyClientCert
  or VerifyClientCertIfGiven without a CA verifies against the system roots (accepted);
- cipher_suites: Go's tls.CipherSuites() names (TLS 1.3 names accepted, and ignored as Go ignores them);
  with http2 (the default) Go's net/http requires TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256 or the ECDSA one in
  the list, else the listener fails to start;
- curve_preferences: CurveP256, CurveP384, CurveP521, X25519; min/max_version TLS10..TLS13;
- headers: only Strict-Transport-Security, X-Content-Type-Options (exactly "nosniff"), X-Frame-Options
  (exactly "deny" or "sameorigin"), X-XSS-Protection, Content-Security-Policy; YAML scalars become strings;
- basic_auth_users: each value must be a bcrypt hash;
- rate_limit: {interval: duration, burst: int}; interval 0 disables it; beyond the burst: 429.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from volprobe import webconfig
from volprobe.config import ConfigError

from .support import toolkit
from .support.harness import volprobe_command
from .support.pki import make_pki

OK, BAD, REFUSE = "accept", "reject", "refuse"


def tls(extra: str = "") -> str:
    return "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key" + extra + "}\n"


CASES = [
    ("empty file", "", OK, ""),
    ("plain TLS", tls(), OK, ""),
    ("empty tls_server_config is no TLS", "tls_server_config: {}\n", OK, ""),
    ("mTLS", tls(", client_auth_type: RequireAndVerifyClientCert, client_ca_file: {pki}/ca.crt"), OK, ""),
    ("mTLS, system roots", tls(", client_auth_type: RequireAndVerifyClientCert"), OK, ""),
    ("verify if given, system roots", tls(", client_auth_type: VerifyClientCertIfGiven"), OK, ""),
    ("verify if given, with CA", tls(", client_auth_type: VerifyClientCertIfGiven, client_ca_file: {pki}/ca.crt"), OK, ""),
    ("any client cert", tls(", client_auth_type: RequireAnyClientCert"), REFUSE, "client_auth_type"),
    ("legacy RequireClientCert", tls(", client_auth_type: RequireClientCert"), REFUSE, "client_auth_type"),
    ("unknown client auth", tls(", client_auth_type: Sometimes"), BAD, "client_auth_type"),
    ("CA without client auth", tls(", client_ca_file: {pki}/ca.crt"), BAD, "client_ca_file"),
    ("allowed SANs", tls(", client_auth_type: RequireAndVerifyClientCert, client_ca_file: {pki}/ca.crt, "
                         "client_allowed_sans: [client.example]"), OK, ""),
    ("TLS 1.2 ciphers", tls(", cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, "
                            "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384], max_version: TLS12"), OK, ""),
    ("TLS 1.3 names too", tls(", cipher_suites: [TLS_AES_128_GCM_SHA256, TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]"), OK, ""),
    ("invented cipher", tls(", cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA2048]"), BAD, "cipher_suites"),
    ("http2 without its cipher", tls(", cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]"), BAD, "cipher_suites"),
    ("no http2, any cipher", tls(", cipher_suites: [TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384]")
     + "http_server_config: {http2: false}\n", OK, ""),
    ("server cipher order off", tls(", prefer_server_cipher_suites: false"), OK, ""),
    ("one curve", tls(", curve_preferences: [CurveP521]"), OK, ""),
    ("several curves", tls(", curve_preferences: [CurveP256, X25519]"), REFUSE, "curve_preferences"),
    ("invented curve", tls(", curve_preferences: [CurveP257]"), BAD, "curve_preferences"),
    ("TLS 1.3 only", tls(", min_version: TLS13"), OK, ""),
    ("wrong TLS version", tls(", min_version: TLS111"), BAD, "min_version"),
    ("empty cert_file", "tls_server_config: {cert_file: '', key_file: {pki}/server.key}\n", BAD, "cert"),
    ("empty key", "tls_server_config: {cert_file: {pki}/server.crt, key: ''}\n", BAD, "key"),
    ("missing cert file", "tls_server_config: {cert_file: {pki}/nonesuch, key_file: {pki}/server.key}\n", BAD, "cert_file"),
    ("a key that is not the cert's", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/client.key}\n",
     BAD, "tls_server_config"),
    ("only client auth", "tls_server_config: {client_auth_type: NoClientCert}\n", BAD, "cert"),
    ("unknown key", "tls_server_config: {cert_filse: {pki}/server.crt}\n", BAD, "cert_filse"),
    ("junk", "hWkNKCp3fvIx3jKnsaBI\n", BAD, "web config"),
    ("users without TLS", "basic_auth_users: {alice: '$2y$10$qRTBuFoULoYNA7AQ/F3ck.trZBPyjV64.oA4ZsSBCIWvXuvQlQTuu'}\n", OK, ""),
    ("a user's password in clear", "basic_auth_users: {john: doe}\n", BAD, "basic_auth_users"),
    ("security headers", "http_server_config: {headers: {X-Frame-Options: deny, X-Content-Type-Options: nosniff, "
                         "X-XSS-Protection: 1, Strict-Transport-Security: max-age=31536000}}\n", OK, ""),
    ("Content-Type header", "http_server_config: {headers: {Content-Type: foo}}\n", BAD, "Content-Type"),
    ("X-Frame-Options made up", "http_server_config: {headers: {X-Frame-Options: foo}}\n", BAD, "X-Frame-Options"),
    ("X-Content-Type-Options sniff", "http_server_config: {headers: {X-Content-Type-Options: sniff}}\n", BAD,
     "X-Content-Type-Options"),
    ("rate limit off", "rate_limit: {interval: 0, burst: 0}\n", OK, ""),
    ("rate limit", "rate_limit: {interval: 1s, burst: 5}\n", OK, ""),
    ("inline cert and key", "tls_server_config: {cert: {pem:server.crt}, key: {pem:server.key}}\n", OK, ""),
    ("inline client CA", tls(", client_auth_type: RequireAndVerifyClientCert, client_ca: {pem:ca.crt}"), OK, ""),
    ("inline cert that is not PEM", "tls_server_config: {cert: 'not a certificate', key: {pem:server.key}}\n", BAD, "tls_server_config"),
    ("file and inline: the file wins", tls(", cert: 'not a certificate'"), OK, ""),
    ("missing client CA file", tls(", client_auth_type: RequireAndVerifyClientCert, client_ca_file: {pki}/nonesuch"), BAD, "client_ca_file"),
    ("request a client cert", tls(", client_auth_type: RequestClientCert"), OK, ""),
    ("SANs on unverified certs", tls(", client_auth_type: RequestClientCert, client_allowed_sans: [client]"), REFUSE, "client_allowed_sans"),
    ("SANs not a list", tls(", client_auth_type: RequireAndVerifyClientCert, client_ca_file: {pki}/ca.crt, client_allowed_sans: client"), BAD, "client_allowed_sans"),
    ("RSA key exchange cipher", tls(", cipher_suites: [TLS_RSA_WITH_AES_128_GCM_SHA256]"), BAD, "cipher_suites"),
    ("only TLS 1.3 cipher names", tls(", cipher_suites: [TLS_AES_128_GCM_SHA256]"), BAD, "cipher_suites"),
    ("duplicate key", "tls_server_config: {}\ntls_server_config: {}\n", BAD, "tls_server_config"),
    ("http2 not a boolean", "http_server_config: {http2: maybe}\n", BAD, "http2"),
    ("X-Frame-Options in capitals", "http_server_config: {headers: {X-Frame-Options: DENY}}\n", BAD, "X-Frame-Options"),
    ("rate limit, burst not a number", "rate_limit: {interval: 1s, burst: five}\n", BAD, "burst"),
    ("rate limit, interval not a duration", "rate_limit: {interval: fast, burst: 5}\n", BAD, "interval"),
    ("SANs without client certificates", tls(", client_allowed_sans: [scraper.example]"), REFUSE, "client_allowed_sans"),
    ("TLS 1.0 allowed", tls(", min_version: TLS10"), REFUSE, "min_version"),
    ("only TLS 1.3 cipher names, no http2", tls(", cipher_suites: [TLS_AES_128_GCM_SHA256]")
     + "http_server_config: {http2: false}\n", OK, ""),
    ("TLS on, no certificate", "tls_server_config: {min_version: TLS13}\n", OK, ""),
    ("header value from a number", "http_server_config: {headers: {Strict-Transport-Security: 31536000}}\n", OK, ""),
    ("rate limit in nanoseconds", "rate_limit: {interval: 1000000000, burst: 2}\n", OK, ""),
    ("rate limit, a Go duration", "rate_limit: {interval: 1m30.5s, burst: 2}\n", OK, ""),
    ("a header split by a line break", 'http_server_config: {headers: {Content-Security-Policy: "default-src self\\r\\nSet-Cookie: a=b"}}\n',
     REFUSE, "Content-Security-Policy"),
    ("rate limit, no burst", "rate_limit: {interval: 1m}\n", OK, ""),
]  # fmt: skip


def test_the_table_covers_the_format():
    assert len(CASES) >= 36
    assert {c[2] for c in CASES} == {OK, BAD, REFUSE}
    assert len({c[0] for c in CASES}) == len(CASES)


def write_case(directory: Path, pki: Path, index: int, text: str) -> Path:
    """The case's file: {pki} is the test PKI's directory, {pem:NAME} a PEM file's text, inline."""
    text = re.sub(r"\{pem:([\w.-]+)\}", lambda m: json.dumps((pki / m.group(1)).read_text()), text)
    path = directory / f"case-{index:02d}.yml"
    path.write_text(text.replace("{pki}", str(pki)))
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory, exporter_toolkit) -> dict[str, tuple[Path, tuple[str, str]]]:
    """name -> (its file, exporter-toolkit's decision on it)."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    directory = tmp_path_factory.mktemp("cases")
    paths = [write_case(directory, pki, i, case[1]) for i, case in enumerate(CASES)]
    decisions = toolkit.validate(exporter_toolkit, paths)
    return {case[0]: (path, decisions[str(path)]) for case, path in zip(CASES, paths, strict=True)}


@pytest.mark.parametrize(("name", "text", "outcome", "key"), CASES, ids=[c[0] for c in CASES])
def test_volprobe_decides_as_exporter_toolkit(cases, name, text, outcome, key):
    path, (toolkit_decision, toolkit_message) = cases[name]
    expected = "reject" if outcome == BAD else "accept"
    assert toolkit_decision.startswith(expected), f"exporter-toolkit: {toolkit_decision} {toolkit_message}"
    if outcome == OK:
        webconfig.load(str(path))
        return
    with pytest.raises(ConfigError) as raised:
        webconfig.load(str(path))
    assert key in str(raised.value), f"the problem must name {key!r}: {raised.value}"


def test_check_config_validates_the_web_config_too(cases, tmp_path):
    config = tmp_path / "volprobe.yml"
    config.write_text("targets: []\n")
    good, _ = cases["mTLS"]
    result = subprocess.run(
        volprobe_command("check-config", str(config), "--web.config.file", str(good)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "web config" in result.stdout and "TLS" in result.stdout and "RequireAndVerifyClientCert" in result.stdout
    bad, _ = cases["X-Frame-Options made up"]
    result = subprocess.run(
        volprobe_command("check-config", str(config), "--web.config.file", str(bad)),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "http_server_config.headers.X-Frame-Options" in result.stderr

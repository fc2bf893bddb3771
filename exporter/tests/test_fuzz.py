"""Bad input, generated (issue 13): the configuration, the mixin configuration and the web configuration never
raise anything but ConfigError, and every problem names its key."""

from __future__ import annotations

import random
import re
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from volprobe import config, mixin, webconfig
from volprobe.config import ConfigError

from .harness import volprobe_command

KEYS = [
    # volprobe.yml
    "defaults", "targets", "diskstats", "throttle", "discovery", "state_directory", "interval", "window", "jitter",
    "revisit", "buckets", "probe_file_size", "name", "device", "directory", "allow_raw_writes", "probes", "limits",
    "warmup", "op", "block_size", "sync", "iops", "bandwidth", "mode", "rate", "jobs", "idle_priority", "enabled",
    "sample_interval", "backoff", "include", "exclude", "rescan_interval",
    # web.yml
    "tls_server_config", "http_server_config", "basic_auth_users", "cert_file", "key_file", "client_ca_file",
    "client_auth_type", "min_version", "max_version", "cipher_suites", "headers", "http2",
]  # fmt: skip
# Values that YAML gives: scalars of every type, the units volprobe parses, and nesting.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1s", "0s", "-1s", "5m", "1h30m", "10us", "4KiB", "64MiB", "1GB", "0", "read", "write", "all"]),
    st.sampled_from(["/dev/loop0", "/tmp", "relative/path", "", "loop\\d+", "[", "VerifyClientCertIfGiven"]),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), children, max_size=4),
    ),
    max_leaves=12,
)
DOCUMENTS = st.one_of(VALUES, st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=6))
KEY_PATH = re.compile(r"^\S.*?: ")  # a key path (or the file, for the whole document) before the message


def check_problems(err: ConfigError) -> None:
    assert err.problems
    for problem in err.problems:
        assert isinstance(problem, str) and KEY_PATH.match(problem), problem


# Derandomized: CI runs the same examples every time (a failure reproduces); explore with
# `pytest --hypothesis-seed=random exporter/tests/test_fuzz.py` and add what it finds as an @example.
FUZZ = settings(max_examples=800, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(DOCUMENTS)
@example([])
@example({" ": None})
@example({"targets": [{"name": "a\n", "device": "/dev/x"}]})
def test_configuration(document):
    try:
        config.parse(document)
    except ConfigError as err:
        check_problems(err)


@FUZZ
@given(
    st.one_of(DOCUMENTS, st.dictionaries(st.sampled_from([f.name for f in mixin.fields(mixin.MixinConfig)]), VALUES))
)
def test_mixin_configuration(document):
    try:
        mixin.from_mapping(document)
    except ConfigError as err:
        check_problems(err)


@FUZZ
@given(DOCUMENTS)
@example({"0\n": None})
@example({"tls_server_config": {"client_auth_type": [], "min_version": {}, "cipher_suites": [[]]}})
@example({"\n": None})
def test_web_configuration(tmp_path_factory, document):
    try:
        webconfig.parse(yaml.safe_dump(document), base=str(tmp_path_factory.getbasetemp()))
    except ConfigError as err:
        check_problems(err)


@pytest.mark.parametrize("seed", range(3))
def test_check_config_exits_2_with_a_key_never_a_traceback(tmp_path, seed):
    """The command line end of it: a few generated files through `volprobe check-config`."""
    rng = random.Random(seed)
    documents = [
        {
            "targets": [
                {"device": rng.choice(["/dev/null", "x", 5]), "probes": rng.choice([[{"op": "trim"}], "x", None])}
            ]
        },
        {
            "defaults": {"buckets": rng.choice([["1ms", "1ms"], "x", [-1]])},
            "throttle": rng.choice([[], {"window": "1s"}]),
        },
        {"discovery": {"include": rng.choice(["[", ["("], 5])}},
    ]
    for document in documents:
        path = tmp_path / "volprobe.yml"
        path.write_text(yaml.safe_dump(document))
        result = subprocess.run(volprobe_command("check-config", str(path)), capture_output=True, text=True)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (document, result.stderr)
        assert all(KEY_PATH.match(line.removeprefix("volprobe: ")) for line in result.stderr.splitlines()), (
            result.stderr
        )

"""Bad input, generated (issue 13): the configuration, the mixin configuration and the web configuration never
raise anything but ConfigError, and every problem names its key. State files (issue 24): whatever they hold is
resumed as it was or set aside, and nothing resumed makes a later write raise."""

from __future__ import annotations

import copy
import json
import math
import random
import re
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from volprobe import config, mixin, ops, schema, state, warmup, webconfig
from volprobe.config import ConfigError
from volprobe.probe import OffsetPicker

from .support.harness import volprobe_command

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
# Valid files generated from the schema cover its keys in fewer examples than arbitrary documents need.
SCHEMA_FUZZ = settings(FUZZ, max_examples=250)


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


# -- what the schema says: valid configs round-trip, each mutation is refused naming its key ---------------------

# Values of the keys that rules between keys constrain, chosen so that every generated file is valid: probe
# intervals well inside the window, blocks well inside the probe file, a throttle window of 10 samples or more.
PINNED: dict[tuple[type, str], tuple[object, ...]] = {
    (config.ProbeConfig, "interval"): ("500ms", "1s"),
    (config.ProbeConfig, "block_size"): (4096, "4KiB", "64KiB"),
    (config.Defaults, "interval"): ("500ms", "1s"),
    (config.Defaults, "window"): ("5m", "1h30m"),
    (config.Defaults, "probe_file_size"): ("64MiB", "1GB"),
    (config.TargetConfig, "probe_file_size"): ("64MiB", "1GB"),
    (config.ThrottleConfig, "sample_interval"): ("500ms", "1s"),
    (config.ThrottleConfig, "window"): ("1m", "1h30m"),
    (config.ThrottleConfig, "backoff"): (1, 2000),
    (config.WarmupConfig, "mode"): ("read",),  # write warm-ups: raw devices with no write probe (test_config)
}


@st.composite
def settings_of(draw, cls: type, skip: tuple[str, ...] = ()) -> dict[str, object]:
    """Some of the settings `cls` declares (and those of its inline sections), each one of its kind's valid
    values (or a pinned one)."""
    document: dict[str, object] = {}
    for name, declared in schema.declarations(cls).items():
        if isinstance(declared, schema.Section) and declared.inline:
            document.update(draw(settings_of(declared.cls, skip)))
        elif isinstance(declared, schema.Setting) and name not in skip and draw(st.booleans()):
            document[name] = draw(st.sampled_from(PINNED.get((cls, name), declared.kind.valid)))
    return document


@st.composite
def probes(draw, writes: bool, directory: bool = False) -> list[dict[str, object]]:
    # commit and metadata: directory targets only, and always synced
    allowed = [op.name for op in ops.OPS.values() if directory or not op.directory_only] if writes else ["read"]
    names = draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
    result = []
    for name in names:
        probe = {**draw(settings_of(config.ProbeConfig, skip=("op", "sync", "hold_open"))), "op": name}
        if ops.get(name).buffered:
            probe.update(draw(st.sampled_from([{}, {"sync": True}, {"hold_open": True}])))
        elif ops.get(name).writes:
            probe.update(draw(st.sampled_from([{}, {"sync": True}, {"sync": False}, {"hold_open": True}])))
        else:
            probe.update(draw(st.sampled_from([{}, {"sync": False}, {"hold_open": True}, {"hold_open": False}])))
        result.append(probe)
    return result


@st.composite
def valid_configs(draw) -> dict[str, object]:
    """A volprobe.yml that the schema and the rules between keys accept."""
    document: dict[str, object] = draw(settings_of(config.Config))
    if draw(st.booleans()):
        document["defaults"] = draw(settings_of(config.Defaults, skip=("buckets",)))
    targets = []
    for index in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            target = {**draw(settings_of(config.TargetConfig, skip=("probe_file_size",))), "device": f"/dev/v{index}"}
            target.pop("directory", None)
            target["name"] = f"t{index}"
            raw_writes = target.get("allow_raw_writes") is True
            if draw(st.booleans()):
                target["probes"] = draw(probes(writes=raw_writes))
            if draw(st.booleans()):
                target["warmup"] = draw(settings_of(config.WarmupConfig))
        else:
            target = {
                **draw(settings_of(config.TargetConfig, skip=("allow_raw_writes", "device"))),
                "name": f"t{index}",
            }
            target["directory"] = f"/srv/d{index}"
            if draw(st.booleans()):
                target["probes"] = draw(probes(writes=True, directory=True))
        if draw(st.booleans()):
            target["limits"] = draw(settings_of(config.Limits))
        targets.append(target)
    if targets or draw(st.booleans()):
        document["targets"] = targets
    if draw(st.booleans()):
        document["throttle"] = draw(settings_of(config.ThrottleConfig))
    if draw(st.booleans()):
        discovery = draw(settings_of(config.DiscoveryConfig))
        if draw(st.booleans()):
            discovery["probes"] = draw(probes(writes=False))
        if draw(st.booleans()):
            discovery["warmup"] = draw(settings_of(config.DiscoveryWarmupConfig))
        document["discovery"] = discovery
    return document


def expect_settings(cls: type, written: dict, built: object, inherited: dict | None = None) -> None:
    """Each setting of `built` is what its kind makes of the value written, else what `inherited` (the
    defaults section) sets, else its declared default."""
    for name, declared in schema.declarations(cls).items():
        if isinstance(declared, schema.Section) and declared.inline:
            expect_settings(declared.cls, written, getattr(built, name))
            continue
        if not isinstance(declared, schema.Setting):
            continue
        if name in written:
            expected = declared.kind.parse(written[name])
        elif inherited and inherited.get(name) is not None:
            expected = inherited[name]
        else:
            expected = schema.default_of(cls, name)
        if (cls, name) == (config.ProbeConfig, "block_size") and name not in written:
            expected = built.kind.default_block_size
        if (cls, name) == (config.ProbeConfig, "sync") and name not in written:
            expected = built.kind.writes
        assert getattr(built, name) == expected, (cls.__name__, name, written)


def expect_probes(written: list | None, built: tuple, defaults: config.Defaults, default_ops: tuple[str, ...]) -> None:
    if written is None:
        written = [{"op": name} for name in default_ops]
    assert [p.op for p in built] == [p["op"] for p in written]
    for raw, probe in zip(written, built, strict=True):
        expect_settings(config.ProbeConfig, raw, probe, defaults.probe())


def expect_config(document: dict, parsed: config.Config) -> None:
    """The whole parsed configuration is what the schema says of the document."""
    expect_settings(config.Config, document, parsed)
    defaults = parsed.defaults
    expect_settings(config.Defaults, document.get("defaults", {}), defaults)
    assert (parsed.window, parsed.buckets, parsed.histogram_by_touch) == (
        defaults.window,
        defaults.buckets,
        defaults.histogram_by_touch,
    )
    assert len(parsed.targets) == len(document.get("targets", []))
    for index, (raw, target) in enumerate(zip(document.get("targets", []), parsed.targets, strict=True)):
        assert target.key == f"targets[{index}]"
        inherited = {"probe_file_size": defaults.probe_file_size} if "directory" in raw else {}
        expect_settings(config.TargetConfig, raw, target, inherited)
        default_ops = ("write", "read") if "directory" in raw else ("read",)
        expect_probes(raw.get("probes"), target.probes, defaults, default_ops)
        expect_settings(config.Limits, raw.get("limits", {}), target.limits)
        assert (target.warmup is None) == ("warmup" not in raw)
        if target.warmup is not None:
            expect_settings(config.WarmupConfig, raw["warmup"], target.warmup)
    expect_settings(config.ThrottleConfig, document.get("throttle", {}), parsed.throttle)
    assert (parsed.discovery is None) == ("discovery" not in document)
    if parsed.discovery is not None:
        raw = document["discovery"]
        expect_settings(config.DiscoveryConfig, raw, parsed.discovery)
        expect_probes(raw.get("probes"), parsed.discovery.probes, defaults, ("read",))
        assert (parsed.discovery.warmup is None) == ("warmup" not in raw)
        if parsed.discovery.warmup is not None:
            expect_settings(config.DiscoveryWarmupConfig, raw["warmup"], parsed.discovery.warmup)


@SCHEMA_FUZZ
@given(valid_configs())
def test_a_valid_configuration_round_trips(document):
    """Generated from the schema, dumped as YAML, parsed: every value is what the schema makes of it."""
    expect_config(document, config.parse(yaml.safe_load(yaml.safe_dump(document))))


def places(document: object, key: str = "") -> list[tuple[str, dict, str]]:
    """Every (key path, mapping, name) of a setting or section written in a document."""
    found = []
    if isinstance(document, dict):
        for name, value in document.items():
            path = schema.key_path(key, name)
            found.append((path, document, name))
            found.extend(places(value, path))
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found.extend(places(value, f"{key}[{index}]"))
    return found


def kind_at(path: str) -> schema.Kind | None:
    """The kind of the setting at a key path of volprobe.yml (None: a section, or a key of no setting)."""
    cls: type = config.Config
    parts = re.findall(r"[A-Za-z_]+", path)
    for depth, name in enumerate(parts):
        declared = {**schema.declarations(cls), **_inline_settings(cls)}.get(name)
        if declared is None:
            return None
        if isinstance(declared, schema.Setting):
            return declared.kind if depth == len(parts) - 1 else None
        cls = declared.cls
    return None


def _inline_settings(cls: type) -> dict:
    return {
        name: setting
        for declared in schema.declarations(cls).values()
        if isinstance(declared, schema.Section) and declared.inline
        for name, setting in schema.declarations(declared.cls).items()
    }


@settings(SCHEMA_FUZZ, max_examples=60)
@given(valid_configs(), SCALARS)
def test_each_mutation_is_refused_naming_its_key(document, stranger):
    """Each setting of a valid file in turn set to each value its kind refuses (a wrong type, out of bounds),
    and an unknown key added to each mapping in turn: refused, and a problem names that key."""
    mutants: list[tuple[str, dict]] = []
    for index, (path, _, _) in enumerate(places(document)):
        kind = kind_at(path)
        for value in kind.invalid if kind else ():
            if value is not None:  # null is "unset" in volprobe.yml (test_null_is_the_same_as_unset)
                mutant = copy.deepcopy(document)
                _, mapping, name = places(mutant)[index]
                mapping[name] = value
                mutants.append((path, mutant))
    for index, (path, _, _) in enumerate([("", {"": document}, ""), *places(document)]):
        mutant = copy.deepcopy(document)
        mapping = mutant if index == 0 else places(mutant)[index - 1][1][places(mutant)[index - 1][2]]
        if isinstance(mapping, dict):
            mapping["not_a_key"] = stranger
            mutants.append((schema.key_path(path, "not_a_key"), mutant))
    for path, mutant in mutants:
        with pytest.raises(ConfigError) as refused:
            config.parse(yaml.safe_load(yaml.safe_dump(mutant)))
        assert any(p.startswith(f"{path}: ") for p in refused.value.problems), (path, refused.value.problems)


@SCHEMA_FUZZ
@given(valid_configs(), st.data())
def test_null_is_the_same_as_unset(document, data):
    """A setting set to null in volprobe.yml keeps its default: the file reads as without the key."""
    settings = [(path, mapping, name) for path, mapping, name in places(document) if kind_at(path)]
    if not settings:
        return
    path, mapping, name = data.draw(st.sampled_from(settings))
    if path.endswith(".op"):  # a probe's op is required: null is refused naming it
        mapping[name] = None
        with pytest.raises(ConfigError) as refused:
            config.parse(document)
        assert any(p.startswith(f"{path}: is required") for p in refused.value.problems)
        return
    mapping[name] = None
    with_null = outcome(document)
    del mapping[name]
    assert with_null == outcome(document)


def outcome(document: dict) -> config.Config | list[str]:
    """The parsed configuration, or its problems (a required key unset is refused either way)."""
    try:
        return config.parse(document)
    except ConfigError as err:
        return err.problems


def valid_mixin() -> st.SearchStrategy[dict[str, object]]:
    return settings_of(mixin.MixinConfig)


@SCHEMA_FUZZ
@given(valid_mixin())
def test_a_valid_mixin_configuration_round_trips(document):
    parsed = mixin.from_mapping(yaml.safe_load(yaml.safe_dump(document)))
    expect_settings(mixin.MixinConfig, document, parsed)


@SCHEMA_FUZZ
@given(valid_mixin(), st.sampled_from(list(schema.declarations(mixin.MixinConfig))), st.data())
def test_each_mixin_mutation_is_refused_naming_its_key(document, name, data):
    """The mixin takes null as a value: refused like any value of the wrong type."""
    declared = schema.declarations(mixin.MixinConfig)[name]
    if data.draw(st.booleans()):
        document[name] = data.draw(st.sampled_from([*declared.kind.invalid, None]))
    else:
        name = data.draw(st.text(min_size=1, max_size=8).filter(lambda n: n not in schema.keys(mixin.MixinConfig)))
        document[name] = data.draw(SCALARS)
    with pytest.raises(ConfigError) as refused:
        mixin.from_mapping(document)
    assert any(p.startswith(f"mixin: {schema.key_path('', name)}") for p in refused.value.problems), (
        name,
        refused.value.problems,
    )


WEB_SECTIONS = {"http_server_config": webconfig._HTTPSettings, "rate_limit": webconfig._RateLimitSettings}


@st.composite
def valid_web_configs(draw) -> dict[str, object]:
    """A web config without TLS (whose files test_webconfig_table checks against exporter-toolkit)."""
    document = {}
    for name, cls in WEB_SECTIONS.items():
        if draw(st.booleans()):
            document[name] = draw(settings_of(cls, skip=("headers",)))
    return document


@SCHEMA_FUZZ
@given(valid_web_configs())
def test_a_valid_web_configuration_round_trips(document):
    parsed = webconfig.parse(yaml.safe_dump(document))
    http, limit = document.get("http_server_config", {}), document.get("rate_limit", {})
    assert parsed.http2 == web_value(webconfig.GO_BOOL, http.get("http2", True))
    interval = web_value(webconfig.GO_DURATION, limit.get("interval", 0))
    burst = web_value(webconfig.GO_INT, limit.get("burst", 0))
    assert parsed.rate_limit == (webconfig.RateLimit(interval, burst) if interval != 0 else None)


def web_value(kind: schema.Kind, value: object) -> object:
    """What a web config kind (which reads YAML nodes) makes of a value."""
    return kind.parse(yaml.compose(yaml.safe_dump(value)))


@SCHEMA_FUZZ
@given(valid_web_configs(), st.data())
def test_each_web_mutation_is_refused_naming_its_key(document, data):
    section = data.draw(st.sampled_from(list(WEB_SECTIONS)))
    cls = WEB_SECTIONS[section]
    body = document.setdefault(section, {})
    settings = [n for n, d in schema.declarations(cls).items() if isinstance(d, schema.Setting) and d.kind.invalid]
    if data.draw(st.booleans()):
        name = data.draw(st.sampled_from(settings))
        body[name] = data.draw(st.sampled_from(schema.declarations(cls)[name].kind.invalid))
    else:
        name = "not_a_key"
        body[name] = data.draw(SCALARS)
    with pytest.raises(ConfigError) as refused:
        webconfig.parse(yaml.safe_dump(document))
    assert any(p.startswith(f"{section}.{name}: ") for p in refused.value.problems), refused.value.problems


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


# -- state files ---------------------------------------------------------------------------------------------------


def leaves(value: object, depth: int = 1) -> list[tuple[object, int]]:
    """Every scalar of a JSON value, with how deep the arrays and objects around it nest."""
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return [leaf for child in children for leaf in leaves(child, depth + 1)] or [(None, depth)]
    return [(value, depth - 1)]


STATE_TEXTS = st.one_of(
    DOCUMENTS.map(json.dumps),  # NaN, Infinity and ints up to 2**70 among them
    st.integers(0, 2 * state.MAX_DEPTH).map(lambda n: "[" * n + "]" * n),
    st.text(max_size=40),
    st.sampled_from(["1e400", "-1e400", '{"a": NaN}', "-Infinity", "1" * 30, "[1.5e308, -0.0]", '"\\ud800"', "1 2"]),
)


@SCHEMA_FUZZ
@given(STATE_TEXTS)
@example("[" * 100_000)
@example("9" * 5000)
def test_state_file_parser(text):
    """What is accepted is JSON as volprobe writes it: shallow, finite numbers, ints in range; it reads back
    as itself. What is refused (ValueError) is exactly what is not."""
    try:
        document = state.parse_state(text)
    except ValueError:
        assert not as_volprobe_writes(text), text[:200]
        return
    assert as_volprobe_writes(text), text[:200]
    for leaf, depth in leaves(document):
        assert depth <= state.MAX_DEPTH
        if isinstance(leaf, float):
            assert math.isfinite(leaf)
        elif isinstance(leaf, int):
            assert -state.MAX_INT < leaf < state.MAX_INT
    assert state.parse_state(json.dumps(document, allow_nan=False)) == document


def as_volprobe_writes(text: str) -> bool:
    """The state file format, decided apart from parse_state: strict JSON (no NaN, Infinity, or number out of
    float range), containers at most MAX_DEPTH deep, ints below MAX_INT in magnitude."""

    def refuse(constant: str) -> None:
        raise ValueError(constant)

    try:
        document = json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError):  # not JSON, NaN, a 4301-digit int, nested past the recursion limit
        return False
    if containers_depth(document) > state.MAX_DEPTH:
        return False
    for leaf, _ in leaves(document):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            return False
        if isinstance(leaf, int) and not isinstance(leaf, bool) and not -state.MAX_INT < leaf < state.MAX_INT:
            return False
    return True


def containers_depth(value: object) -> int:
    if isinstance(value, dict | list):
        children = value.values() if isinstance(value, dict) else value
        return 1 + max((containers_depth(child) for child in children), default=0)
    return 0


NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
CREATED = (
    st.integers(0, 2**33 - 1)
    | st.floats(0, 2**33 - 1)
    | st.sampled_from([-1, 2**33, 1e300, math.inf, math.nan, "1", None, True])
)
CURSOR = st.fixed_dictionaries(  # as written
    {"key": st.integers(0, 2**64 - 1), "next": st.integers(0, 2000)},
    optional={
        "used": st.integers(0, 2000),
        "gaps": st.lists(st.lists(st.integers(0, 2000), min_size=2, max_size=2), max_size=32),
    },
)
CROSSED = [("key", -1), ("key", 2**64), ("key", True), ("next", 2**63), ("next", 1.0), ("used", -1), ("gaps", {})]
CURSORS = st.one_of(
    CURSOR,
    st.tuples(CURSOR, st.sampled_from(CROSSED)).map(lambda c: {**c[0], c[1][0]: c[1][1]}),  # a limit crossed
    st.dictionaries(st.sampled_from(["key", "next", "used", "gaps"]), NUMBERS | st.lists(NUMBERS), max_size=4),
)
PROBES = st.dictionaries(st.sampled_from(["read", "write"]), CURSORS, max_size=2) | VALUES


@SCHEMA_FUZZ
@given(CREATED, st.dictionaries(st.sampled_from(["read", "write"]), CURSOR, max_size=2) | PROBES)
@example(1e400, {})
@example(1.7e9, {"read": {"key": 7, "next": 2**63 - 1, "used": 0, "gaps": [[0, 2**63 - 1]] * 32}})
def test_volume_state(tmp_path_factory, created, probes):
    """A volume's state is resumed as it was, or set aside; either way its probes then pick offsets and write
    the state without raising, and what was written is resumed at the next start."""
    directory = tmp_path_factory.mktemp("state")
    identity = state.VolumeIdentity("serial:x", "serial", 1 << 30)
    path = directory / identity.file_name()
    document = {"version": 1, "identity": identity.to_json(), "created": created, "sections": {"probes": probes}}
    path.write_text(json.dumps(document))
    volume = state.VolumeState(str(directory), identity)
    assert (volume.status == "corrupt") == bool(list(directory.glob("*.corrupt-*")))
    if volume.status == "ok":
        assert volume.created == created and volume.get("probes") == probes
    else:
        assert volume.status == "corrupt" and volume.get("probes") is None
    for name in ("read", "write"):
        picker = OffsetPicker(1000, 0.5, random.Random(1), cursor=state.ProbeCursor(volume, name, 7, 10))
        picked = [picker.next() for _ in range(40)]
        picker.close()
        assert all(0 <= block < 1000 for block, _ in picked)
    again = state.VolumeState(str(directory), identity)
    assert again.status == "ok" and again.get("probes") == volume.get("probes")


def union(ranges: list[list[int]]) -> int:
    """How many blocks the ranges cover, overlaps counted once."""
    covered, end = 0, 0
    for start, stop in sorted(ranges):
        covered += max(0, stop - max(start, end))
        end = max(end, stop)
    return covered


BLOCKS = st.integers(-2, 300) | st.integers(0, 10**13) | st.booleans() | st.floats(0, 300)
IN_RANGE = st.tuples(st.integers(0, 300), st.integers(1, 40)).map(lambda r: [r[0], r[0] + r[1]])
RANGES = st.one_of(
    IN_RANGE,
    st.tuples(st.integers(0, 10**13), st.integers(1, 10**6)).map(lambda r: [r[0], r[0] + r[1]]),  # long ones
    st.lists(BLOCKS, max_size=3),
    VALUES,
)


@SCHEMA_FUZZ
@given(st.integers(1, 400) | st.integers(1, 10**13), st.lists(IN_RANGE, max_size=8) | st.lists(RANGES, max_size=8))
@example(2 * 10**12, [[1, 10**12]])
@example(10, [[5, 6], [0, 5], [7, 8]])
def test_checkpoint_extents(nblocks, ranges):
    """Extents accepted from a checkpoint are the blocks its ranges cover, within the device, at most
    MAX_ABOVE of them above the mark; they are saved as they were read."""
    try:
        extents = warmup.Extents.from_list(nblocks, ranges)
    except ValueError:
        return
    assert 0 <= extents.mark <= nblocks and len(extents.above) <= warmup.Extents.MAX_ABOVE
    assert all(extents.mark < block < nblocks for block in extents.above)
    assert len(extents) == union(ranges)
    if nblocks <= 400:
        assert set(range(nblocks)) - set(extents.pending()) == {b for start, end in ranges for b in range(start, end)}
    again = warmup.Extents.from_list(nblocks, extents.to_list())
    assert (again.mark, again.above) == (extents.mark, extents.above)

"""Bad configs are rejected with the offending key named; good ones give the documented defaults."""

import contextlib
import signal
import subprocess
import textwrap
import time

import pytest
import yaml

from volprobe import config, yamlfile

from .support.harness import probes_done, sample_value, start_with_kept_target, volprobe_command, wait_until
from .support.hostile_yaml import chain, laughs

# (name, YAML, the key path the first problem must name, a word the message must contain)
BAD_CONFIGS = [
    ("unknown top-level key", "targetz: []", "targetz", "unknown key"),
    ("targets not a list", "targets: {a: 1}", "targets", "must be a list"),
    ("target not a mapping", "targets: [/dev/sda]", "targets[0]", "must be a mapping"),
    ("neither device nor directory", "targets: [{name: x}]", "targets[0]", "needs a device or a directory"),
    ("both device and directory", "targets: [{device: /dev/a, directory: /tmp}]", "targets[0]", "both"),
    ("relative device path", "targets: [{device: sda}]", "targets[0].device", "absolute path"),
    ("unknown target key", "targets: [{device: /dev/a, interval: 1s}]", "targets[0].interval", "unknown key"),
    ("op missing", "targets: [{device: /dev/a, probes: [{block_size: 4KiB}]}]", "targets[0].probes[0].op", "required"),
    ("bad op", "targets: [{device: /dev/a, probes: [{op: trim}]}]", "targets[0].probes[0].op", "not one of"),
    (
        "bad size",
        "targets: [{device: /dev/a, probes: [{op: read, block_size: 4kb8}]}]",
        "targets[0].probes[0].block_size",
        "not a size",
    ),
    (
        "zero block size",
        "targets: [{device: /dev/a, probes: [{op: read, block_size: 0}]}]",
        "targets[0].probes[0].block_size",
        "larger than zero",
    ),
    (
        "duration without unit",
        "targets: [{device: /dev/a, probes: [{op: read, interval: 5}]}]",
        "targets[0].probes[0].interval",
        "with a unit",
    ),
    (
        "zero interval",
        "targets: [{device: /dev/a, probes: [{op: read, interval: 0s}]}]",
        "targets[0].probes[0].interval",
        "longer than zero",
    ),
    (
        "revisit above 1",
        "targets: [{device: /dev/a, probes: [{op: read, revisit: 1.5}]}]",
        "targets[0].probes[0].revisit",
        "outside 0..1",
    ),
    (
        "hold_open false on a write",
        "targets: [{directory: /tmp, probes: [{op: write, hold_open: false}]}]",
        "targets[0].probes[0].hold_open",
        "write probes always keep",
    ),
    (
        "hold_open false on a commit",
        "targets: [{directory: /tmp, probes: [{op: commit, hold_open: false}]}]",
        "targets[0].probes[0].hold_open",
        "commit probes always keep",
    ),
    (
        "hold_open not a boolean",
        "targets: [{device: /dev/a, probes: [{op: read, hold_open: sometimes}]}]",
        "targets[0].probes[0].hold_open",
        "",
    ),
    (
        "sync on a read",
        "targets: [{device: /dev/a, probes: [{op: read, sync: true}]}]",
        "targets[0].probes[0].sync",
        "only applies to write",
    ),
    (
        "raw write without opt-in",
        "targets: [{device: /dev/a, probes: [{op: write}]}]",
        "targets[0].probes[0].op",
        "allow_raw_writes",
    ),
    (
        "two read probes",
        "targets: [{device: /dev/a, probes: [{op: read}, {op: read, block_size: 8KiB}]}]",
        "targets[0].probes[1].op",
        "collide",
    ),
    ("empty probe list", "targets: [{device: /dev/a, probes: []}]", "targets[0].probes", "non-empty"),
    (
        "duplicate names",
        "targets: [{name: a, device: /dev/a}, {name: a, device: /dev/b}]",
        "targets[1].name",
        "already",
    ),
    ("bad name", "targets: [{name: 'my disk', device: /dev/a}]", "targets[0].name", "not a valid name"),
    (
        "probe file too small",
        "targets: [{directory: /tmp, probe_file_size: 8KiB}]",
        "targets[0].probes[0].block_size",
        "no room",
    ),
    (
        "probe_file_size on a device",
        "targets: [{device: /dev/a, probe_file_size: 1MiB}]",
        "targets[0].probe_file_size",
        "directory targets",
    ),
    (
        "window shorter than two probes",
        "defaults: {window: 1s}\ntargets: [{device: /dev/a}]",
        "defaults.window",
        "fewer than two",
    ),
    (
        "too many buckets",
        "defaults: {buckets: [" + ", ".join(f"{i + 1}ms" for i in range(60)) + "]}",
        "defaults.buckets",
        "at most 50",
    ),
    ("bad warm-up mode", "targets: [{device: /dev/a, warmup: {mode: trim}}]", "targets[0].warmup.mode", "not one of"),
    (
        "write warm-up without opt-in",
        "targets: [{device: /dev/a, warmup: {mode: write}}]",
        "targets[0].warmup.mode",
        "allow_raw_writes",
    ),
    ("negative limit", "targets: [{device: /dev/a, limits: {iops: -5}}]", "targets[0].limits.iops", "positive"),
    ("throttle window too short", "throttle: {window: 5s}", "throttle.window", "at least 10"),
    ("bad discovery regex", "discovery: {include: ['nvme[']}", "discovery.include", "regular expression"),
    ("bad diskstats scope", "diskstats: some", "diskstats", "not one of"),
]


@pytest.mark.parametrize(("name", "text", "key", "word"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_key(name, text, key, word, tmp_path):
    path = tmp_path / "volprobe.yml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as caught:
        config.load(path)
    first = caught.value.problems[0]
    assert first.startswith(f"{key}:"), caught.value.problems
    assert word in first, first


def test_at_least_fifteen_bad_configs():
    assert len(BAD_CONFIGS) >= 15


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yml"
    path.write_text("targets:\n  - device: /dev/a\n   name: [\n")
    with pytest.raises(config.ConfigError) as caught:
        config.load(path)
    assert "line 3" in caught.value.problems[0]


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "volprobe.yml"
    path.write_text("targets: [{device: sda, probes: [{op: trim}]}, {name: 'a b', device: /dev/b}]")
    with pytest.raises(config.ConfigError) as caught:
        config.load(path)
    assert len(caught.value.problems) == 3


def test_the_documented_example_parses_with_defaults(tmp_path):
    path = tmp_path / "volprobe.yml"
    path.write_text(
        textwrap.dedent("""
        defaults: {interval: 1s, window: 5m}
        targets:
          - name: pgdata
            directory: /var/lib/postgresql
            probe_file_size: 64MiB
            probes:
              - {op: write, block_size: 8KiB, interval: 1s, sync: true}
              - {op: read, block_size: 4KiB, interval: 1s}
          - name: data
            device: /dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0
            probes:
              - {op: read, block_size: 4KiB, interval: 500ms, hold_open: true}
    """)
    )
    parsed = config.load(path)
    assert parsed.window == 300
    pgdata, data = parsed.targets
    assert pgdata.probe_file_size == 64 << 20
    assert [(p.op, p.block_size, p.sync) for p in pgdata.probes] == [("write", 8192, True), ("read", 4096, False)]
    assert data.probes[0].interval == 0.5
    assert data.probes[0].revisit == config.ProbeConfig.revisit
    assert data.probes[0].hold_open and not pgdata.probes[1].hold_open


def test_write_probes_default_to_o_dsync():
    parsed = config.parse({"targets": [{"directory": "/tmp", "probes": [{"op": "write"}]}]})
    assert parsed.targets[0].probes[0].sync is True
    assert parsed.targets[0].probes[0].block_size == 8192


def test_check_config_exits_2_and_names_the_key(tmp_path):
    path = tmp_path / "volprobe.yml"
    path.write_text("targets: [{device: /dev/a, probes: [{op: read, block_size: 4kb8}]}]")
    result = subprocess.run(volprobe_command("check-config", str(path)), capture_output=True, text=True)
    assert result.returncode == 2
    assert "targets[0].probes[0].block_size" in result.stderr


def test_exporter_exits_2_on_bad_config_before_listening(tmp_path):
    path = tmp_path / "volprobe.yml"
    path.write_text("targets: [{device: /dev/a, probes: [{op: write}]}]")
    result = subprocess.run(
        volprobe_command("--config", str(path), "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "targets[0].probes[0].op" in result.stderr


# Files a configuration management tool, or a mistake, can leave (issue 41): (name, bytes, what the refusal says)
HOSTILE_FILES = [
    ("a Latin-1 byte", b"targets: []\n# caf\xe9\n", "not UTF-8 text: byte 0xe9 at line 2"),
    ("2000-deep nesting", b"targets: " + b"[" * 2000 + b"]" * 2000 + b"\n", "nested more than 32 deep"),
    ("over 1 MiB", b"targets: []\n" + (b"#" * 1023 + b"\n") * 1100, "more than a configuration may be"),
    # Aliases: walked, the first's one name was 10^9 values, and its error message took 11 GiB and minutes.
    ("billion laughs", laughs() + b"targets: [{name: *l5, directory: /tmp}]\n", "more than 100000 added"),
    (
        "a 100 KB path named by 20 aliases",
        b"targets:\n  - {name: t0, directory: &p /"
        + b"a" * 100_000
        + b"}\n"
        + b"".join(b"  - {name: t%d, directory: *p}\n" % i for i in range(1, 21)),
        "more than 1048576 added",
    ),
    ("aliases 40 deep", chain() + b"targets: [{name: *c39, directory: /tmp}]\n", "32 deep through aliases"),
    ("an alias inside its anchor", b"targets: [{name: &a [*a], directory: /tmp}]\n", "inside the node it names"),
    # Not text (issue 52): YAML's reader refused a NUL in three lines; a byte order mark was skipped unseen.
    ("a NUL", b"targets: []\n# a\x00b\n", "a control character (U+0000) at line 2, column 4"),
    ("a byte order mark", b"\xef\xbb\xbftargets: []\n", "a byte order mark (U+FEFF) at line 1, column 1"),
    ("an escape in a value", b'targets: [{name: "a\x1bb", directory: /tmp}]\n', "targets[0].name: a control character"),
]


def test_aliases_within_their_bounds_load(tmp_path):
    """Anchors and aliases as a configuration uses them: a thousand targets sharing one list of probes (the bound
    on what aliases add leaves room for ten times that), each target's probes the very list written once."""
    path = tmp_path / "volprobe.yml"
    lines = ["targets:"]
    lines += [
        f"  - {{name: t{i}, device: /dev/t{i}, allow_raw_writes: true, probes: "
        + ("&probes [{op: read, interval: 2s}, {op: write}]}" if i == 0 else "*probes}")
        for i in range(1000)
    ]
    path.write_text("\n".join(lines) + "\n")
    loaded = config.load(path)
    assert len(loaded.targets) == 1000
    assert {(str(p.op), p.interval) for t in loaded.targets for p in t.probes} == {("read", 2.0), ("write", 1.0)}


def test_shared_aliases_and_merge_keys_load(tmp_path):
    """An anchor named by aliases in several places, nested in another that is named too, and a merge key: none
    is taken for a cycle or refused."""
    path = tmp_path / "volprobe.yml"
    path.write_text(
        "targets:\n"
        "  - {name: a, device: /dev/a, allow_raw_writes: true,\n"
        "     probes: &both [&read {op: read, interval: 2s}, {<<: *read, op: write}]}\n"
        "  - {name: b, device: /dev/b, allow_raw_writes: true, probes: *both}\n"
        "  - {name: c, device: /dev/c, probes: [*read]}\n"
    )
    loaded = config.load(path)
    assert [[(str(p.op), p.interval) for p in t.probes] for t in loaded.targets] == [
        [("read", 2.0), ("write", 2.0)],
        [("read", 2.0), ("write", 2.0)],
        [("read", 2.0)],
    ]


def test_a_node_named_by_many_aliases_is_measured_once():
    """The alias check looks at a node named by N aliases once, not N times: a list of 50,000 values named by
    50,000 aliases (refused) is checked in about the time a document of as many nodes without aliases takes, not
    50,000 times as long. A ratio within each round (best of three), never an absolute time."""
    width = 50_000

    def scalars(n: int) -> list[yaml.ScalarNode]:
        return [yaml.ScalarNode("tag:yaml.org,2002:str", "0") for _ in range(n)]

    def timed(document: yaml.Node) -> float:
        started = time.perf_counter()
        with contextlib.suppress(yaml.YAMLError):
            yamlfile._check_aliases(document)
        return time.perf_counter() - started

    seq = "tag:yaml.org,2002:seq"
    shared = yaml.SequenceNode(seq, scalars(width))
    aliased = yaml.SequenceNode(seq, [shared, yaml.SequenceNode(seq, [shared] * width)])
    written = yaml.SequenceNode(seq, [yaml.SequenceNode(seq, scalars(width)), yaml.SequenceNode(seq, scalars(width))])
    ratios = [timed(aliased) / timed(written) for _ in range(3)]
    assert min(ratios) < 5, ratios


def test_what_aliases_may_add_is_bounded_exactly():
    """100,000 values added by aliases load; one more is refused."""
    row = b"&row [" + b", ".join([b"x"] * 99) + b"]"  # 100 values: the list and its 99
    at_the_bound = b"rows: [" + row + b", " + b", ".join([b"*row"] * 1000) + b"]\n"
    assert len(yaml.load(at_the_bound, Loader=yamlfile.Loader)["rows"]) == 1001
    with pytest.raises(yaml.YAMLError, match="more than 100000 added"):
        yaml.load(at_the_bound.replace(b"]\n", b", &one y, *one]\n"), Loader=yamlfile.Loader)


@pytest.mark.parametrize("content,why", [pytest.param(c, w, id=n) for n, c, w in HOSTILE_FILES])
def test_a_hostile_config_file_is_refused_naming_the_file_and_why(tmp_path, content, why):
    path = tmp_path / "volprobe.yml"
    path.write_bytes(content)
    with pytest.raises(config.ConfigError) as refused:
        config.load(path)
    assert refused.value.problems[0].startswith(f"{path}: ")
    assert why in refused.value.problems[0]


@pytest.mark.parametrize("content,why", [pytest.param(c, w, id=n) for n, c, w in HOSTILE_FILES])
def test_the_exporter_exits_2_on_a_hostile_config_in_one_line(tmp_path, content, why):
    """Exit 2, not 1: systemd's RestartPreventExitStatus=2 then stops the restart loop."""
    path = tmp_path / "volprobe.yml"
    path.write_bytes(content)
    result = subprocess.run(
        volprobe_command("--config", str(path), "--web.listen-address", "127.0.0.1:0"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert str(path) in result.stderr and why in result.stderr


def test_a_sighup_with_a_hostile_config_keeps_the_running_one(tmp_path, start_exporter):
    """Each hostile file in turn, then SIGHUP: refused with the reason logged, the exporter and its probe run on,
    volprobe_config_last_reload_successful 0; a good file after them loads."""
    exporter, path, good = start_with_kept_target(tmp_path, start_exporter)
    refused = "rejected, keeping the running one"
    for _name, content, why in HOSTILE_FILES:
        rejections = exporter.log().count(refused)
        path.write_bytes(content)
        exporter.process.send_signal(signal.SIGHUP)
        wait_until(
            lambda n=rejections: exporter.log().count(refused) > n or exporter.process.poll(),
            what="the rejection",
            every=0.05,
        )
        assert exporter.process.poll() is None, exporter.log()[-3000:]
        assert why in exporter.log()
        before = probes_done(exporter.metrics(), "kept", "write")
        samples = exporter.wait_for(lambda s, n=before: probes_done(s, "kept", "write") > n, what="the probe to go on")
        assert sample_value(samples, "volprobe_config_last_reload_successful") == 0
    exporter.reload(path, good)
    assert sample_value(exporter.metrics(), "volprobe_config_last_reload_successful") == 1
    assert "Traceback" not in exporter.log()
    assert exporter.stop() == 0

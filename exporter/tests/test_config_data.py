"""A configuration is data, never code or dates (issue 52): every key of volprobe.yml and of the web config, each
set to each wrong value YAML can write (a date, an integer of 5,000 digits, a float or a negative where an integer
goes, a nested mapping, a list for a scalar, a scalar for a section, bytes that are not UTF-8, an empty string,
null, tags of other types), is refused naming its file and its key, in one line each; never a traceback, never
another exit code than 2. A running exporter given such a file keeps serving its running configuration and says
the reload failed.

The keys are enumerated from the schema's declarations, so a key added to a dataclass is walked too. Whether a
value must be refused is the key's kind's own verdict on what the value is as written (a date written in the file
is the string it looks like): these tests check that every value reaches that verdict, whatever it is, and that
nothing between the file and the verdict breaks on the way."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from volprobe import config, schema, webconfig, yamlfile
from volprobe.tools.check_config import run_check_config

from .support.harness import (
    parse_metrics,
    probes_done,
    sample_value,
    start_with_kept_target,
    volprobe_command,
    wait_until,
)

PLACE = "PLACEHOLDER"
YAML_REFUSED = object()  # refused before any key's check: not text, or not a type a configuration holds
DIGITS_5000 = "9" * 5000

# (what the file holds as the key's value, what that value is: the Python value its key's kind is asked about,
# or YAML_REFUSED). Text unless bytes.
WRONG: list[tuple[str | bytes, Any]] = [
    # dates and timestamps: strings, as they look (YAML 1.1 made dates of them; 2001-02-30 ended the process)
    ("2001-02-30", "2001-02-30"),
    ("2001-02-03", "2001-02-03"),
    ("2001-12-14t21:59:43.10-05:00", "2001-12-14t21:59:43.10-05:00"),
    ("2002-12-14 21:59:43", "2002-12-14 21:59:43"),
    # huge numbers: an integer of more than 30 digits is refused as written; as a string, its kind judges it
    (DIGITS_5000, YAML_REFUSED),
    ("-" + DIGITS_5000, YAML_REFUSED),
    ("1" + "0" * 30, YAML_REFUSED),
    (f"'{DIGITS_5000}'", DIGITS_5000),
    ("9" * 400 + "KiB", "9" * 400 + "KiB"),
    ("9" * 400 + "s", "9" * 400 + "s"),
    ("1" + "0" * 29, 10**29),
    ("1.0e+400", math.inf),
    # negative, float, non-finite where an integer goes
    ("-1", -1),
    ("-4096", -4096),
    ("0", 0),
    ("1.5", 1.5),
    ("-0.5", -0.5),
    (".inf", math.inf),
    ("-.inf", -math.inf),
    (".nan", math.nan),
    # YAML 1.1's other integers: sexagesimal and octal stay strings; hexadecimal and binary are integers
    ("1:30", "1:30"),
    ("010", "010"),
    ("0x10", 16),
    ("0b101", 5),
    ("yes", True),
    ("=", "="),
    # containers where they do not go
    ("{a: {b: {c: 1}}}", {"a": {"b": {"c": 1}}}),
    ("[1, 2]", [1, 2]),
    ("[[]]", [[]]),
    ("{}", {}),
    ("[]", []),
    ("x", "x"),
    # empty, null
    ("''", ""),
    ('""', ""),
    ("null", None),
    ("", None),
    # a NUL written as an escape: a string holding one
    ('"/\\0"', "/\0"),
    # not text: bytes that are not UTF-8, a NUL, a byte order mark, C0 controls
    (b"caf\xe9", YAML_REFUSED),
    (b"\xff\xfe", YAML_REFUSED),
    ("a\0b", YAML_REFUSED),
    ("\ufeffx", YAML_REFUSED),
    ("a\x1bb", YAML_REFUSED),
    # explicit tags: of types no configuration holds, or text their type cannot hold
    ("!!timestamp 2001-01-01", YAML_REFUSED),
    ("!!timestamp 2001-02-30", YAML_REFUSED),
    ("!!bool maybe", YAML_REFUSED),
    ("!!int x", YAML_REFUSED),
    ("!!float x", YAML_REFUSED),
    (f"!!int {DIGITS_5000}", YAML_REFUSED),
    ("!!binary aGk=", YAML_REFUSED),
    ("!!set {a}", YAML_REFUSED),
    ("!!python/object/apply:os.system [true]", YAML_REFUSED),
    ("!!str {a: 1}", YAML_REFUSED),
]
# The values that ended or broke the process before issue 52, for the live reloads (each key, each of these).
CRASHERS = [
    "2001-02-30",
    DIGITS_5000,
    "9" * 400 + "KiB",
    "!!bool maybe",
    b"caf\xe9",
    "{a: {b: {c: 1}}}",
]


# -- the keys, from the schema ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Key:
    path: tuple[str | int, ...]  # where it sits: names, and 0 for the first item of a list of sections
    declared: schema.Setting | schema.Section
    owners: tuple[type, ...]  # the dataclass of each mapping along the path, from the file's down to the key's

    @property
    def name(self) -> str:
        text = ""
        for part in self.path:
            text = schema.key_path(text, part)
        return text


def keys_of(cls: type, path: tuple[str | int, ...] = (), owners: tuple[type, ...] | None = None) -> Iterator[Key]:
    """Every key a file of `cls` may hold, sections and settings, nested ones too (a list of sections by its
    first item), as the schema declares them."""
    owners = (cls,) if owners is None else owners
    for name, declared in schema.declarations(cls).items():
        if isinstance(declared, schema.Section) and declared.inline:  # its keys are written in this mapping
            yield from keys_of(declared.cls, path, owners)
            continue
        yield Key((*path, name), declared, owners)
        if isinstance(declared, schema.Section):
            inner = (*path, name, 0) if declared.many else (*path, name)
            yield from keys_of(declared.cls, inner, (*owners, declared.cls))


def required(cls: type) -> dict[str, Any]:
    """The settings of `cls` that must be written, each a valid value of its kind."""
    return {
        name: declared.kind.valid[0]
        for name, declared in schema.declarations(cls).items()
        if isinstance(declared, schema.Setting) and schema.default_of(cls, name) is schema.REQUIRED
    }


def document_with(key: Key) -> str:
    """A file of the key's mappings (each with what it requires), the key's value left to PLACE."""
    root: dict[str, Any] = required(key.owners[0])
    mapping = root
    level = 0
    names = [part for part in key.path[:-1] if isinstance(part, str)]
    for index, part in enumerate(key.path[:-1]):
        if isinstance(part, int):
            continue
        level += 1
        inner = required(key.owners[level])
        mapping[part] = [inner] if isinstance(key.path[index + 1], int) else inner
        mapping = inner
    assert level == len(names) == len(key.owners) - 1, key
    mapping.pop(key.path[-1], None)
    mapping[str(key.path[-1])] = PLACE
    return yaml.safe_dump(root, default_flow_style=False, sort_keys=False)


def file_with(key: Key, value: str | bytes) -> bytes:
    text = document_with(key).encode()
    assert text.count(PLACE.encode()) == 1, text
    return text.replace(PLACE.encode(), value if isinstance(value, bytes) else value.encode())


def must_refuse(key: Key, value: Any) -> bool:
    """Whether the key's kind refuses the value (a section: anything but a mapping or a list of them, as it
    is declared; null unsets either)."""
    if value is YAML_REFUSED:
        return True
    if value is None:
        return False  # null is "unset" in volprobe.yml (test_fuzz.test_null_is_the_same_as_unset)
    declared = key.declared
    if isinstance(declared, schema.Section):  # a mapping of its keys (or a list of them): empty is one
        return value != ([] if declared.many else {}) or type(value) is bool
    try:
        declared.kind.parse(value)
    except Exception:
        return True
    return False


VOLPROBE_KEYS = list(keys_of(config.Config))


def test_the_keys_walked_are_the_schemas():
    """The walk covers every declared key, nested sections' too: a few known ones, and as many as declared."""
    names = {key.name for key in VOLPROBE_KEYS}
    assert {"defaults.interval", "targets[0].probes[0].block_size", "kubernetes.rules[0].probes[0].op"} <= names
    assert {"discovery.warmup.mode", "discovery.warmup.policy", "targets[0].warmup.jobs"} <= names
    assert len(VOLPROBE_KEYS) == len(names) > 50


def names_key(line: str, key: str) -> bool:
    """Whether a problem line names the key (or a place inside its value: `key[0]`, `key.a`)."""
    return re.search(rf"(^|: ){re.escape(key)}([:.\[]|$)", line) is not None


def check_outcome(key: str, value: object, rc: int, err: str, path: Path, refuse: bool) -> None:
    lines = err.splitlines()
    where = (key, value if not isinstance(value, str) or len(value) < 50 else value[:50] + "...")
    assert "Traceback" not in err and rc in (0, 2), (where, rc, err[-2000:])
    assert all(line.startswith("volprobe: ") for line in lines), (where, err[-2000:])
    if refuse:
        assert rc == 2, (where, err)
        assert any(line.startswith(f"volprobe: {path}: ") and names_key(line, key) for line in lines), (where, err)


def test_check_config_refuses_every_wrong_value_of_every_key_naming_it(tmp_path, capsys):
    """`volprobe check-config`, in-process: each key of the schema, each value of WRONG. Exit 2 and the key
    named, in a line naming the file, where the key's kind refuses the value; exit 0 or 2, never anything
    else, where it does not (the value is then judged by the rules between keys, or by the machine)."""
    path = tmp_path / "volprobe.yml"
    checked = 0
    for key in VOLPROBE_KEYS:
        for value, meant in WRONG:
            path.write_bytes(file_with(key, value))
            try:
                rc = run_check_config([str(path), "--path.sysfs", str(tmp_path), "--path.devfs", str(tmp_path)])
            except SystemExit as exit_:  # argparse: not a configuration's doing
                raise AssertionError((key.name, value)) from exit_
            check_outcome(key.name, value, rc, capsys.readouterr().err, path, must_refuse(key, meant))
            checked += 1
    assert checked == len(VOLPROBE_KEYS) * len(WRONG)


@pytest.mark.parametrize("value", CRASHERS[:5], ids=["date", "5000 digits", "400-digit size", "!!bool", "latin-1"])
def test_the_commands_exit_2_in_one_line_naming_the_key(tmp_path, value):
    """The processes themselves, for the values that ended them: `volprobe check-config` and the exporter's
    start exit 2 (systemd's RestartPreventExitStatus=2), one line naming the file and the key, no traceback."""
    path = tmp_path / "volprobe.yml"
    written = value if isinstance(value, bytes) else value.encode()
    path.write_bytes(b"targets: [{name: t, directory: /tmp, probe_file_size: " + written + b"}]\n")
    key = "targets[0].probe_file_size"
    for command in (["check-config", str(path)], ["--config", str(path), "--web.listen-address", "127.0.0.1:0"]):
        result = subprocess.run(volprobe_command(*command), capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.startswith(f"volprobe: {path}: ") and names_key(result.stderr.strip(), key), result.stderr


# -- the web config ---------------------------------------------------------------------------------------------

WEB_KEYS = list(keys_of(webconfig.WebDocument))


def web_must_refuse(key: Key, value: Any) -> bool:
    """The web config's kinds read YAML nodes (as Go's yaml.v2 reads them): asked about the node of the value."""
    if value is YAML_REFUSED:
        return True
    declared = key.declared
    node = yaml.compose(yaml.safe_dump(value))  # what the value is, as a node of its type
    if isinstance(node, yaml.ScalarNode) and node.tag.endswith(":null"):
        return False  # null: the zero value, as in Go
    if isinstance(declared, schema.Section) or declared.kind is webconfig.NODE:
        return not isinstance(node, yaml.MappingNode) or bool(node.value)  # {} is empty; others: unknown keys
    try:
        declared.kind.parse(node)
    except Exception:
        return True
    return False


def test_the_web_keys_walked_are_the_schemas():
    names = {key.name for key in WEB_KEYS}
    assert {"tls_server_config.min_version", "rate_limit.burst", "basic_auth_users"} <= names
    assert len(WEB_KEYS) == len(names) > 15


def test_check_config_refuses_every_wrong_value_of_every_web_key_naming_it(tmp_path, capsys):
    """`volprobe check-config --web.config.file`, in-process, each key of the web config and each value."""
    empty = tmp_path / "volprobe.yml"
    empty.write_text("targets: []\n")
    path = tmp_path / "web.yml"
    for key in WEB_KEYS:
        for value, meant in WRONG:
            path.write_bytes(file_with(key, value))
            rc = run_check_config([str(empty), "--web.config.file", str(path)])
            out = capsys.readouterr()
            check_outcome(key.name, value, rc, out.err, path, web_must_refuse(key, meant))


# -- SIGHUP: one exporter, a reload per key and value -------------------------------------------------------------


class Log:
    """The exporter's log, read from where it was last read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def new(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self.offset += end
        return data[:end].decode(errors="replace")


def rejections_of_one_reload(exporter, log: Log, path: Path, key: str) -> list[str]:
    """The problems the reload SIGHUP asked for was refused with, once one names `key` (or the exporter ended):
    those logged after its `SIGHUP: reloading` line, none of an earlier reload's (a reload logs its problems a
    line each: the last ones of the one before may come after the test saw the first)."""
    marker, refused = f"SIGHUP: reloading {path}", "rejected, keeping the running one: "
    seen: list[str] = []
    marked = False

    def named() -> bool:
        nonlocal marked
        for line in log.new().splitlines():
            if marker in line:
                marked = True
                seen.clear()
            elif marked and refused in line:
                seen.append(line.split(refused, 1)[1])
        return any(names_key(line, key) for line in seen) or exporter.process.poll() is not None

    try:
        wait_until(named, timeout=30, every=0.01)
    except AssertionError:
        raise AssertionError(f"no refusal naming {key}: {seen}") from None
    return seen


def scrape(exporter) -> dict:
    return parse_metrics(exporter.get())


def test_a_sighup_with_any_wrong_value_of_any_key_keeps_the_running_configuration(tmp_path, start_exporter):
    """One exporter; for each key and each of the values that ended it before (CRASHERS), the file rewritten and
    SIGHUP: the reload is refused in a line naming the key, /metrics answers with the running target and
    volprobe_config_last_reload_successful 0, and the probe goes on. A good file afterwards loads."""
    exporter, path, good = start_with_kept_target(tmp_path, start_exporter)
    log = Log(exporter.log_path)
    log.new()
    started, reloads = time.monotonic(), 0
    for key in VOLPROBE_KEYS:
        for value in CRASHERS:
            if not must_refuse(key, _meant(value)):
                continue
            path.write_bytes(file_with(key, value))
            exporter.process.send_signal(signal.SIGHUP)
            seen = rejections_of_one_reload(exporter, log, path, key.name)
            assert exporter.process.poll() is None, exporter.log()[-3000:]
            assert any(names_key(line, key.name) for line in seen), (key.name, value[:50], seen)
            samples = scrape(exporter)
            assert sample_value(samples, "volprobe_config_last_reload_successful") == 0
            assert [labels["target"] for labels, _ in samples["volprobe_target_info"]] == ["kept"]
            reloads += 1
    elapsed = time.monotonic() - started
    assert reloads > 5 * len(VOLPROBE_KEYS), reloads
    before = probes_done(scrape(exporter), "kept", "write")
    exporter.wait_for(lambda s: probes_done(s, "kept", "write") > before, what="the probe to go on")
    exporter.reload(path, good)
    assert sample_value(scrape(exporter), "volprobe_config_last_reload_successful") == 1
    assert "Traceback" not in exporter.log()
    assert exporter.stop() == 0
    print(f"{reloads} refused reloads in {elapsed:.1f} s")


def _meant(value: str | bytes) -> Any:
    return next(meant for written, meant in WRONG if written == value)


def test_a_web_config_with_any_wrong_value_of_any_key_does_not_reload(tmp_path, start_exporter):
    """The web config is read again when it changes, at the next connection: for each web key and each of
    CRASHERS, the file replaced, then a scrape: answered under the previous configuration (its header), with
    volprobe_web_config_last_reload_successful 0, and the refusal logged naming the key."""
    good = "http_server_config:\n  headers: {X-Content-Type-Options: nosniff}\n"
    path = tmp_path / "web.yml"
    path.write_text(good)
    (tmp_path / "volprobe.yml").write_text("targets: []\n")
    exporter = start_exporter("--web.config.file", str(path), "--config", str(tmp_path / "volprobe.yml"))
    log = Log(exporter.log_path)
    log.new()
    replaced = 0
    for key in WEB_KEYS:
        for value in CRASHERS:
            if not web_must_refuse(key, _meant(value)):
                continue
            (tmp_path / "web.yml.new").write_bytes(file_with(key, value))
            os.replace(tmp_path / "web.yml.new", path)
            with urllib.request.urlopen(exporter.url + "/metrics", timeout=10) as response:
                assert response.headers["X-Content-Type-Options"] == "nosniff", "the previous configuration serves"
                samples = parse_metrics(response.read().decode())
            assert sample_value(samples, "volprobe_web_config_last_reload_successful") == 0, (key.name, value[:50])
            lines = [line for line in log.new().splitlines() if "not reloaded" in line]
            assert lines and any(key.name in line for line in lines), (key.name, value[:50], lines)
            replaced += 1
    assert replaced > 3 * len(WEB_KEYS), replaced
    assert exporter.process.poll() is None and "Traceback" not in exporter.log()
    assert exporter.stop() == 0


def test_the_wrong_values_are_what_they_say(tmp_path):
    """WRONG's second column, checked against the loader: what each value is, as volprobe reads it (or refused,
    naming the key and the file)."""
    path = tmp_path / "volprobe.yml"
    for value, meant in WRONG:
        path.write_bytes(b"v: " + (value if isinstance(value, bytes) else value.encode()) + b"\n")
        with pytest.raises(config.ConfigError) as refused:  # v is no key of volprobe.yml
            config.load(path)
        problem = refused.value.problems[0]
        if meant is YAML_REFUSED:
            assert problem.startswith(f"{path}: v: "), (value[:50], problem)
        else:
            assert problem.startswith("v: unknown key"), (value[:50], problem)
            got = yaml.load(path.read_text(), Loader=yamlfile.Loader)["v"]
            assert type(got) is type(meant) and (got == meant or (got != got and meant != meant)), (value[:50], got)


@pytest.mark.parametrize("kind", ["directory", "FIFO"])
def test_a_file_that_is_not_a_regular_file_is_refused_naming_it(tmp_path, kind):
    """A configuration, a web config, a web config's certificate that is a directory or a FIFO: refused naming the
    file (and the key that names it), exit 2 in one line; a FIFO is never opened for reading (that waited for a
    writer: the start, or a scrape at the web config's reload, hung)."""
    path = tmp_path / "conf.yml"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    empty = tmp_path / "volprobe.yml"
    empty.write_text("targets: []\n")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config: {{cert_file: {path}, key_file: {path}}}\n")
    for command, said in (
        (["check-config", str(path)], f"volprobe: {path}: is a {kind}, not a regular file"),
        (["--config", str(path), "--web.listen-address", "127.0.0.1:0"], f"volprobe: {path}: is a {kind}"),
        (["check-config", str(empty), "--web.config.file", str(path)], f"volprobe: {path}: is a {kind}"),
        (
            ["check-config", str(empty), "--web.config.file", str(web)],
            f"volprobe: {web}: tls_server_config.cert_file: cannot read {path}: is a {kind}",
        ),
    ):
        result = subprocess.run(volprobe_command(*command), capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (command, result.stderr[-2000:])
        assert result.stderr.startswith(said), (command, result.stderr)
        assert all(
            line.startswith(f"volprobe: {path}: ") or line.startswith(f"volprobe: {web}: ")
            for line in result.stderr.splitlines()
        ), result.stderr

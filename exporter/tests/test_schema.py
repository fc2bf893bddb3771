"""The declarative config schema (issue 26): the walker, and the README's reference generated from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from volprobe import schema
from volprobe.schema import __main__ as generator
from volprobe.schema import section, setting

README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass(frozen=True)
class Inner:
    size: int = setting(4096, schema.POSITIVE_SIZE, "a size")


@dataclass(frozen=True)
class Outer:
    every: float = setting(1.0, schema.POSITIVE_DURATION, "a duration")
    inner: Inner = section(Inner, "one inner")
    inners: tuple[Inner, ...] = section(Inner, "inners", default=(), many=True)


def test_the_walker_builds_the_dataclasses_with_units_parsed():
    walker = schema.Walker()
    built = walker.build(Outer, {"every": "500ms", "inner": {"size": "8KiB"}, "inners": [{}, {"size": 1}]}, "")
    assert walker.problems == []
    assert built == Outer(every=0.5, inner=Inner(8192), inners=(Inner(), Inner(1)))


def test_the_walker_names_every_problem_by_its_key_path():
    walker = schema.Walker()
    walker.build(Outer, {"every": "0s", "inner": {"size": "x", "extra": 1}, "inners": [{}, {"size": -1}], "y": 2}, "")
    assert sorted(p.split(": ")[0] for p in walker.problems) == [
        "every",
        "inner.extra",
        "inner.size",
        "inners[1].size",
        "y",
    ]


def test_null_keeps_the_default_or_is_judged_by_the_kind():
    assert schema.Walker().build(Outer, {"every": None}, "") == Outer()
    strict = schema.Walker(null_unsets=False)
    strict.build(Outer, {"every": None}, "")
    assert [p.split(": ")[0] for p in strict.problems] == ["every"]


@pytest.mark.parametrize(
    "kind",
    [
        schema.POSITIVE_DURATION,
        schema.DURATION,
        schema.POSITIVE_SIZE,
        schema.RATIO,
        schema.BOOLEAN,
        schema.POSITIVE_INT,
        schema.POSITIVE_NUMBER,
        schema.ABSOLUTE_PATH,
        schema.TEXT,
        schema.TEXTS,
        schema.REGEXES,
    ],
    ids=lambda kind: kind.name,
)
def test_each_kind_takes_its_valid_values_and_refuses_its_invalid_ones(kind):
    for value in kind.valid:
        kind.parse(value)
    for value in kind.invalid:
        with pytest.raises(ValueError):
            kind.parse(value)


def test_the_readme_reference_is_generated_from_the_schema():
    """Regenerate with `python -m volprobe.schema --write README.md`."""
    text = README.read_text()
    assert generator.replaced(text, generator.markdown()) == text


def test_the_reference_names_every_declared_key():
    """A key added to a dataclass with setting() shows in the reference, with its documentation."""
    from volprobe import config, mixin, webconfig

    reference = generator.markdown()
    for cls in (config.Config, webconfig.WebDocument, mixin.MixinConfig):
        pending = [cls]
        while pending:
            owner = pending.pop()
            for name, declared in schema.declarations(owner).items():
                assert f"| `{name}` |" in reference, (owner, name)
                if isinstance(declared, schema.Section):
                    pending.append(declared.cls)
                else:
                    assert f"| {declared.doc} |" in reference, (owner, name)

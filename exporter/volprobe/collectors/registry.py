"""The collectors' registry: each collector module registers itself here by name, on import."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.core import Metric

from ..view import RuntimeView


class Collector(Protocol):
    def collect(self) -> list[Metric]: ...


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[RuntimeView], Collector]
    enabled_by_default: bool
    help: str


REGISTRY: dict[str, Registration] = {}


def register(
    name: str, help_text: str, enabled_by_default: bool = True
) -> Callable[[Callable[[RuntimeView], Collector]], Callable[[RuntimeView], Collector]]:
    """Class decorator: make a collector known by `name` (its flag and its `collector` label)."""

    def add(factory: Callable[[RuntimeView], Collector]) -> Callable[[RuntimeView], Collector]:
        REGISTRY[name] = Registration(name, factory, enabled_by_default, help_text)
        return factory

    return add

"""YAML whose aliases make a few lines into more than they look: shared by the configuration's and the web config's
hostile-file tests. Each defines its anchors under a key of its own (`laughs`, `chain`), for the document to use."""

from __future__ import annotations


def laughs(levels: int = 6) -> bytes:
    """A smaller "billion laughs": anchors l0 to l{levels-1}, each a list of ten aliases to the one before (l0: ten
    strings), so that the last stands for 10^levels values once walked. 10^6 is ten times what aliases may add, and
    is walked in seconds should the bound be gone (nine levels took 11 GiB)."""
    lines = [b"laughs:", b"  - &l0 [" + b", ".join([b"ha"] * 10) + b"]"]
    lines += [b"  - &l%d [" % i + b", ".join([b"*l%d" % (i - 1)] * 10) + b"]" for i in range(1, levels)]
    return b"\n".join(lines) + b"\n"


def chain(links: int = 40) -> bytes:
    """Anchors c0 to c{links-1}, each a list of one alias to the one before: the last stands for lists nested
    `links` deep (one level more with the scalar inside), on lines each nested 3 deep."""
    lines = [b"chain:", b"  - &c0 [a]"]
    lines += [b"  - &c%d [*c%d]" % (i, i - 1) for i in range(1, links)]
    return b"\n".join(lines) + b"\n"

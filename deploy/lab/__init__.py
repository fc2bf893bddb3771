"""The volume lab (lab.py) and its tests, importable as `lab` with `deploy` on the path (pyproject.toml's pytest
`pythonpath`): `from lab import lab`."""

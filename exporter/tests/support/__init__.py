"""What the tests share, and only tests and benchmarks import: the harness (commands, devices, the exporter,
Prometheus), and helpers for one concern each. No test module imports another test module; they import from here.
"""

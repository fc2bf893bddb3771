"""volprobe: a Prometheus exporter that probes block volumes with queue-depth-1 direct I/O."""

__version__ = "0.2.0"

"""`volprobe compare`: a migration verdict, baseline against candidate, from a Prometheus holding their probes."""

"""nbdkit python plugin: an emulated cloud volume (latency, throttling, lazy allocation, errors, stalls).

Loaded by `nbdkit python volume_plugin.py state=DIR size=BYTES alloc_unit=BYTES`. Live settings come from
DIR/control.json, re-read every 20 ms by a background thread, so `lab.py set` changes the device without
detaching it; counters go to DIR/stats.json.

The model, per request:
- stall: while set, every request waits (the device "hangs") until it is cleared;
- errors: a read or write fails with EIO with the configured probability;
- throttling: a device-wide token bucket (GCRA) for IOPS and for bandwidth: a request starts no earlier than
  its reservation, whatever process sent it (how providers throttle);
- latency: the request completes `latency` (+- uniform jitter) after it starts, less the emulation chain's
  own measured overhead (`overhead_read`/`overhead_write`, calibrated by lab.py), so qd1 latency seen
  through loop -> FUSE -> NBD matches the configured one;
- tail: a fraction `tail_fraction` of reads and writes, drawn independently, take `tail_latency` instead (a
  replicated volume's slow replica): a tail whose quantiles are known, for measuring a p99 against. Lazy
  first writes and zero reads keep their own latencies: they model the allocator, not the replicas;
- lazy allocation: the first write to a never-written allocation unit takes `first_write_latency` instead,
  and such writes are serialised (one allocator), while reads of never-written units return zeros at once;
- trace: while set, every request served is appended to DIR/requests.log as `r|w OFFSET LENGTH`, so a test
  can tell exactly which blocks a client touched.
"""

import builtins  # this module defines open(), the nbdkit callback; files are opened through builtins
import errno
import json
import mmap
import os
import random
import threading
import time

import nbdkit

API_VERSION = 2

_params = {"state": "", "size": "268435456", "alloc_unit": "1048576"}
# Live settings: lab.py writes every key to control.json before nbdkit starts (see lab.DEFAULTS).
_settings: dict = {}
_counters = {"reads": 0, "writes": 0, "read_bytes": 0, "written_bytes": 0, "errors": 0, "stalled": 0}
_lock = threading.Lock()
_allocator = threading.Lock()
_running = threading.Event()
_running.set()
_data = None
_allocated = None
_reads = None  # bytes read per TRACE_UNIT, in DIR/reads.bin, for tests that check coverage block by block
TRACE_UNIT = 64 * 1024
_bucket = {"ops_tat": 0.0, "bytes_tat": 0.0}
_trace = []  # the open requests.log, once tracing starts


def _record(op, offset, length):
    """Append one served request to the trace (the caller holds _lock)."""
    if not _settings.get("trace"):
        return
    if not _trace:
        # Kept open for the server's life, line buffered: every request is in the file when it completes.
        _trace.append(builtins.open(os.path.join(_params["state"], "requests.log"), "a", buffering=1))  # noqa: SIM115
    _trace[0].write(f"{op} {offset} {length}\n")


def config(key, value):
    if key not in _params:
        raise RuntimeError(f"unknown parameter {key}")
    _params[key] = value


def config_complete():
    global _data, _allocated, _reads
    size = int(_params["size"])
    unit = int(_params["alloc_unit"])
    _data = mmap.mmap(-1, size)  # anonymous: zero pages until written, so RSS follows what was written
    _allocated = bytearray((size + unit - 1) // unit)
    units = (size + TRACE_UNIT - 1) // TRACE_UNIT
    with builtins.open(os.path.join(_params["state"], "reads.bin"), "w+b") as f:
        f.truncate(units * 4)
        _reads = memoryview(mmap.mmap(f.fileno(), units * 4)).cast("I")
    _load_settings(required=True)


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


_watcher = threading.Lock()
_watching = []


def open(readonly):
    # The watcher starts with the first connection: started earlier, its file descriptors race with the
    # ones nbdkit closes and reopens on /dev/null while it sets itself up.
    with _watcher:
        if not _watching:
            _watching.append(threading.Thread(target=_watch, daemon=True))
            _watching[0].start()
    return 1


def get_size(h):
    return int(_params["size"])


def can_write(h):
    return True


def can_flush(h):
    return True


def can_multi_conn(h):
    return True


def can_fua(h):
    return nbdkit.FUA_NATIVE


def flush(h, flags):
    pass


def _load_settings(required=False):
    path = os.path.join(_params["state"], "control.json")
    try:
        with builtins.open(path) as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        if required:
            raise
        return  # mid-replace: the next poll reads it
    _settings.update(loaded)
    if _settings["stall"]:
        _running.clear()
    else:
        _running.set()
    if loaded.get("reset_allocation", 0) != _bucket.get("reset_seen", 0):
        _bucket["reset_seen"] = loaded.get("reset_allocation", 0)
        _allocated[:] = bytes(len(_allocated))
        for i in range(len(_reads)):
            _reads[i] = 0


def _watch():
    control = os.path.join(_params["state"], "control.json")
    stats = os.path.join(_params["state"], "stats.json")
    last = None
    next_stats = 0.0
    while True:
        try:
            stamp = os.stat(control).st_mtime_ns
        except OSError:
            stamp = None
        if stamp != last:
            last = stamp
            _load_settings()
        now = time.monotonic()
        if now >= next_stats:
            next_stats = now + 0.2
            with _lock:
                snapshot = dict(_counters)
            snapshot["generation"] = _settings["generation"]
            snapshot["allocated_ratio"] = sum(_allocated) / max(1, len(_allocated))
            tmp = stats + ".tmp"
            with builtins.open(tmp, "w") as f:
                json.dump(snapshot, f)
            os.replace(tmp, stats)
        time.sleep(0.02)


def _reserve(nbytes, now):
    """Earliest start time allowed by the IOPS and bandwidth buckets; reserves the capacity."""
    iops, bandwidth, burst = _settings["iops_limit"], _settings["bandwidth_limit"], _settings["burst"]
    start = now
    with _lock:
        if iops > 0:
            tat = max(_bucket["ops_tat"], now)
            start = max(start, tat - burst)
            _bucket["ops_tat"] = tat + 1.0 / iops
        if bandwidth > 0:
            tat = max(_bucket["bytes_tat"], now)
            start = max(start, tat - burst)
            _bucket["bytes_tat"] = tat + nbytes / bandwidth
    return start


def _sleep_until(deadline):
    delay = deadline - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _latency(base, overhead, *, tail=True):
    if tail and _settings["tail_fraction"] and random.random() < _settings["tail_fraction"]:
        base = _settings["tail_latency"]
    jitter = _settings["jitter"]
    value = base + (random.uniform(-jitter, jitter) if jitter else 0.0)
    return max(0.0, value - overhead)


def _units(offset, length):
    unit = int(_params["alloc_unit"])
    return range(offset // unit, (offset + length - 1) // unit + 1)


def _begin(kind, nbytes):
    if not _running.is_set():
        with _lock:
            _counters["stalled"] += 1
        _running.wait()
        with _lock:
            _counters["stalled"] -= 1
    if random.random() < _settings["fail_" + kind]:
        with _lock:
            _counters["errors"] += 1
        nbdkit.set_error(errno.EIO)
        raise OSError(errno.EIO, "injected error")
    return _reserve(nbytes, time.monotonic())


def pread(h, buf, offset, flags):
    start = _begin("reads", len(buf))
    units = _units(offset, len(buf))
    if _settings["lazy"] and not any(_allocated[u] for u in units):
        _sleep_until(start + max(0.0, _settings["zero_read_latency"] - _settings["overhead_read"]))
        buf[:] = bytes(len(buf))  # never written: zeros, without touching "media"
    else:
        _sleep_until(start + _latency(_settings["read_latency"], _settings["overhead_read"]))
        buf[:] = _data[offset : offset + len(buf)]
    end = offset + len(buf)
    with _lock:
        _counters["reads"] += 1
        _counters["read_bytes"] += len(buf)
        _record("r", offset, len(buf))
        for unit in range(offset // TRACE_UNIT, (end - 1) // TRACE_UNIT + 1):
            _reads[unit] += min(end, (unit + 1) * TRACE_UNIT) - max(offset, unit * TRACE_UNIT)


def pwrite(h, buf, offset, flags):
    start = _begin("writes", len(buf))
    units = _units(offset, len(buf))
    fresh = _settings["lazy"] and not all(_allocated[u] for u in units)
    if fresh:
        with _allocator:  # one allocation at a time, as a provider's allocator behaves
            if not all(_allocated[u] for u in units):  # another write may have allocated it meanwhile
                latency = _latency(_settings["first_write_latency"], _settings["overhead_write"], tail=False)
                _sleep_until(max(start, time.monotonic()) + latency)
                for u in units:
                    _allocated[u] = 1
            else:
                _sleep_until(start + _latency(_settings["write_latency"], _settings["overhead_write"]))
    else:
        _sleep_until(start + _latency(_settings["write_latency"], _settings["overhead_write"]))
        if not _settings["lazy"]:
            for u in units:
                _allocated[u] = 1
    _data[offset : offset + len(buf)] = buf
    with _lock:
        _counters["writes"] += 1
        _counters["written_bytes"] += len(buf)
        _record("w", offset, len(buf))

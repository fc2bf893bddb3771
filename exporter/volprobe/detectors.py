"""Throttling plateau detection from /proc/diskstats, sampled in the background.

A provider's cap shows as a flat ceiling that demand presses against. For each whole disk under a probed
target, every `sample_interval` (1 s) the sampler records per-second operations and bytes per direction
(read, write, total), how many requests were in flight on average (Little's law: time spent by requests per
second) and their average completion time (await). Over the rolling `window` (60 s), a direction is on a
plateau when all of these hold:

1. enough data: at least MIN_SAMPLES seconds in the window;
2. a real level: the window's high level H (its 90th percentile) is at least MIN_OPS ops/s (MIN_BYTES for
   bandwidth), so an idle device is never "flat";
3. flat: at least FLAT_SHARE of the seconds are within FLAT_TOLERANCE of H;
4. queueing: on average more than QUEUE_MIN requests were in flight. A single-threaded queue-depth-1
   workload keeps at most one in flight, so its flat rate (the device's latency bound) never qualifies;
5. waiting: the average await is at least AWAIT_FACTOR times the device's unloaded service time, the lowest
   10-second median of volprobe's own probe latency seen so far. N threads at queue depth 1 on an unthrottled
   device also run flat with N in flight, but each request still takes the unloaded service time.

The ceiling is the median of the seconds inside the flat band. Whether the cap is on IOPS or on bandwidth:
the flatter of the two signals (lower coefficient of variation over the band, by a fifth and by CV_NOISE at
least) wins; with uniform request sizes both are equally flat, and requests of LARGE_REQUEST bytes or more point
to a bandwidth cap, smaller ones to an IOPS cap; a configured limit that matches the ceiling within 5% settles
it. (On a cap flat to a request a second, both coefficients are a few thousandths and which is lower is noise:
a CI run called a 300 IOPS cap of 4 KiB reads, flat at 300 to 301 a second, a bandwidth cap.)
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import diskstats, supervise
from .osthread import name_this_thread

log = logging.getLogger(__name__)

DIRECTIONS = ("read", "write", "total")
LIMITS = ("iops", "bandwidth")
MIN_SAMPLES = 15
MIN_OPS = 10.0
MIN_BYTES = 1024 * 1024.0
FLAT_SHARE = 0.75
FLAT_TOLERANCE = 0.05
QUEUE_MIN = 1.5
AWAIT_FACTOR = 1.5
LARGE_REQUEST = 32 * 1024
CV_NOISE = 0.01  # coefficients of variation closer than this are equally flat (_which_limit)
HIGH_QUANTILE = 0.9
CHECK_TTL_S = 300.0  # an active check's verdict holds this long while the plateau stays at its level
CHECK_RETRY_S = 60.0  # an inconclusive check is repeated after this
CHECK_LEVEL = 0.10  # "the same plateau": its ceiling within 10% of the one checked
CHECK_MIN_INTERVAL_S = 60.0  # at most one active check per disk this often
# How often the sampler asks the exporter for a disk's unloaded latency and limits when its window cannot hold
# a plateau (Window.may_hold_plateau); a window that may is judged with fresh ones at every sample. The unloaded
# latency only falls, by a 10-probe median at a time (stats.FLOOR_GROUP), and limits change at a reload.
INPUTS_EVERY_S = 30.0
# The most sample intervals one read of /proc/diskstats may cover while every followed disk is idle for certain
# (idle_between): such a read stands for that many QUIET seconds, exactly what reads every second would have
# kept. A disk that turns busy meanwhile is seen from the next read, at most IDLE_STRIDE_MAX - 1 seconds late.
IDLE_STRIDE_MAX = 5


@dataclass(frozen=True)
class Second:
    """One sample: rates over the last interval, per direction."""

    ops: dict[str, float]
    bytes: dict[str, float]
    inflight: dict[str, float]  # average requests in flight
    await_s: dict[str, float]  # average completion time (NaN without completions)


def second_between(
    before: diskstats.DiskStats, after: diskstats.DiskStats, elapsed: float, *, quiet_if_idle: bool = False
) -> Second | None:
    """Rates between two diskstats readings of one device; None across a counter reset. With quiet_if_idle, QUIET
    for a second too idle to sit in any flat band: fewer than BUSY_OPS requests and BUSY_BYTES bytes a second, all
    directions together. Such a second is never in a band, and the high level is the same or below rule 2's
    whatever its rates were, so its rates change no verdict (the sampler keeps it so)."""
    reads = after.reads_completed - before.reads_completed
    writes = after.writes_completed - before.writes_completed
    read_ms = after.read_time_ms - before.read_time_ms
    write_ms = after.write_time_ms - before.write_time_ms
    read_bytes = after.bytes_read - before.bytes_read
    write_bytes = after.bytes_written - before.bytes_written
    if min(reads, writes, read_ms, write_ms, read_bytes, write_bytes) < 0 or elapsed <= 0:
        return None
    if quiet_if_idle and reads + writes < BUSY_OPS * elapsed and read_bytes + write_bytes < BUSY_BYTES * elapsed:
        return QUIET

    def wait(ms: int, ops: int) -> float:
        return ms / 1000 / ops if ops else float("nan")

    return Second(
        ops={"read": reads / elapsed, "write": writes / elapsed, "total": (reads + writes) / elapsed},
        bytes={
            "read": read_bytes / elapsed,
            "write": write_bytes / elapsed,
            "total": (read_bytes + write_bytes) / elapsed,
        },
        inflight={
            "read": read_ms / 1000 / elapsed,
            "write": write_ms / 1000 / elapsed,
            "total": (read_ms + write_ms) / 1000 / elapsed,
        },
        await_s={
            "read": wait(read_ms, reads),
            "write": wait(write_ms, writes),
            "total": wait(read_ms + write_ms, reads + writes),
        },
    )


def _requests_and_bytes(before: diskstats.DiskStats, after: diskstats.DiskStats) -> tuple[int, int]:
    """Requests completed and bytes moved between two readings, all directions together."""
    ops = after.reads_completed - before.reads_completed + after.writes_completed - before.writes_completed
    return ops, after.bytes_read - before.bytes_read + after.bytes_written - before.bytes_written


def idle_between(before: diskstats.DiskStats, after: diskstats.DiskStats, interval: float) -> bool | None:
    """Whether every interval between two readings (however many lie between them) was certainly QUIET: fewer
    than BUSY_OPS requests and BUSY_BYTES bytes per second of one interval in all of them together. None across
    a counter reset."""
    ops, moved = _requests_and_bytes(before, after)
    if min(ops, moved, after.read_time_ms - before.read_time_ms, after.write_time_ms - before.write_time_ms) < 0:
        return None
    return ops < BUSY_OPS * interval and moved < BUSY_BYTES * interval


def idle_stride(before: diskstats.DiskStats, after: diskstats.DiskStats, elapsed: float, interval: float) -> int:
    """How many intervals the next read may cover with its disk certainly idle through them, if it goes on at
    the rate it had between these readings (a disk already idle): 1 to IDLE_STRIDE_MAX."""
    if elapsed <= 0:
        return 1
    ops, moved = _requests_and_bytes(before, after)
    stride = IDLE_STRIDE_MAX
    for done, limit in ((ops, BUSY_OPS), (moved, BUSY_BYTES)):
        per_interval = done / elapsed * interval
        while stride > 1 and stride * per_interval >= limit * interval:
            stride -= 1
    return stride


@dataclass(frozen=True)
class Plateau:
    limit: str  # "iops" or "bandwidth"
    ceiling_ops: float
    ceiling_bytes: float
    inflight: float
    await_s: float


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _flat_band(values: list[float], minimum: float) -> list[int] | None:
    """Indices of the seconds within FLAT_TOLERANCE of the high level, if they are most of the window."""
    high = _quantile(values, HIGH_QUANTILE)
    if high < minimum:
        return None
    band = [i for i, v in enumerate(values) if abs(v - high) <= FLAT_TOLERANCE * high]
    return band if len(band) >= FLAT_SHARE * len(values) else None


def _cv(values: list[float]) -> float:
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else float("inf")


@dataclass(frozen=True)
class Candidate:
    """A window that is flat and queued (rules 1 to 4): a plateau if its await is long enough (rule 5)."""

    band: list[int]
    ops_band: list[int] | None
    bytes_band: list[int] | None
    ceiling_ops: float
    ceiling_bytes: float
    inflight: float
    await_s: float


def candidate(seconds: list[Second], direction: str) -> Candidate | None:
    """Rules 1 to 4 of the module docstring: enough samples, a real level, flat, queueing."""
    if len(seconds) < MIN_SAMPLES:
        return None
    ops = [s.ops[direction] for s in seconds]
    rates = [s.bytes[direction] for s in seconds]
    ops_band = _flat_band(ops, MIN_OPS)
    bytes_band = _flat_band(rates, MIN_BYTES)
    if ops_band is None and bytes_band is None:
        return None
    band = ops_band if ops_band is not None else bytes_band
    assert band is not None
    inflight = statistics.fmean(seconds[i].inflight[direction] for i in band)
    if inflight < QUEUE_MIN:
        return None
    waits = [seconds[i].await_s[direction] for i in band if not math.isnan(seconds[i].await_s[direction])]
    return Candidate(
        band,
        ops_band,
        bytes_band,
        statistics.median(ops[i] for i in band),
        statistics.median(rates[i] for i in band),
        inflight,
        statistics.fmean(waits) if waits else 0.0,
    )


def waits_long(found: Candidate, unloaded_s: float | None) -> bool:
    """Rule 5: requests take well over the disk's unloaded service time."""
    return unloaded_s is not None and found.await_s >= AWAIT_FACTOR * unloaded_s


def plateau_of(
    seconds: list[Second], direction: str, found: Candidate, limit_ops: float | None, limit_bytes: float | None
) -> Plateau:
    ops = [s.ops[direction] for s in seconds]
    rates = [s.bytes[direction] for s in seconds]
    limit = _which_limit(
        ops, rates, found.ops_band, found.bytes_band, found.ceiling_ops, found.ceiling_bytes, limit_ops, limit_bytes
    )
    return Plateau(limit, found.ceiling_ops, found.ceiling_bytes, found.inflight, found.await_s)


def evaluate(
    seconds: list[Second],
    direction: str,
    unloaded_s: float | None,
    limit_ops: float | None = None,
    limit_bytes: float | None = None,
) -> Plateau | None:
    """The plateau of one direction over a window of samples, or None (the rule is in the module docstring)."""
    found = candidate(seconds, direction)
    if found is None or not waits_long(found, unloaded_s):
        return None
    return plateau_of(seconds, direction, found, limit_ops, limit_bytes)


def _which_limit(
    ops: list[float],
    rates: list[float],
    ops_band: list[int] | None,
    bytes_band: list[int] | None,
    ceiling_ops: float,
    ceiling_bytes: float,
    limit_ops: float | None,
    limit_bytes: float | None,
) -> str:
    if limit_ops and abs(ceiling_ops - limit_ops) <= 0.05 * limit_ops:
        return "iops"
    if limit_bytes and abs(ceiling_bytes - limit_bytes) <= 0.05 * limit_bytes:
        return "bandwidth"
    if ops_band is None:
        return "bandwidth"
    if bytes_band is None:
        return "iops"
    band = sorted(set(ops_band) & set(bytes_band)) or ops_band
    cv_ops, cv_bytes = _cv([ops[i] for i in band]), _cv([rates[i] for i in band])
    if abs(cv_ops - cv_bytes) > max(0.2 * max(cv_ops, cv_bytes), CV_NOISE):
        return "iops" if cv_ops < cv_bytes else "bandwidth"
    return "bandwidth" if ceiling_bytes / max(ceiling_ops, 1e-9) >= LARGE_REQUEST else "iops"


class Window:
    """The last `size` seconds of one device, with a count per direction of those busy enough to sit in a flat
    band: at least (1 - FLAT_TOLERANCE) times rule 2's level, in ops or in bytes. A window with fewer of them
    than FLAT_SHARE holds no plateau (rules 2 and 3), which is known without looking at its seconds: most
    disks are idle most of the time, and the sampler judges every disk every second."""

    def __init__(self, size: int) -> None:
        self.seconds: deque[Second] = deque(maxlen=size)
        self.busy = dict.fromkeys(DIRECTIONS, 0)

    def append(self, second: Second) -> None:
        if len(self.seconds) == self.seconds.maxlen and self.seconds[0] is not QUIET:
            self._count(self.seconds[0], -1)
        self.seconds.append(second)
        if second is not QUIET:
            self._count(second, 1)

    def clear(self) -> None:
        self.seconds.clear()
        self.busy = dict.fromkeys(DIRECTIONS, 0)

    def may_hold_plateau(self, direction: str) -> bool:
        """Rules 1 to 3 can hold: enough seconds, and enough of them busy. False means candidate() is None."""
        n = len(self.seconds)
        return n >= MIN_SAMPLES and self.busy[direction] >= FLAT_SHARE * n

    def may_hold_any(self, adding: Second | None = None) -> bool:
        """may_hold_plateau() in some direction; with `adding`, as it would be once that second is added (or
        a little more, never less: the second that would leave is not taken off)."""
        n = len(self.seconds)
        most = max(self.busy.values())
        if adding is not None:
            n = min(n + 1, self.seconds.maxlen or 0)
            most += adding is not QUIET and any(busy(adding, d) for d in DIRECTIONS)
        return n >= MIN_SAMPLES and most >= FLAT_SHARE * n

    def _count(self, second: Second, step: int) -> None:
        for direction in DIRECTIONS:
            if busy(second, direction):
                self.busy[direction] += step

    def __iter__(self) -> Iterator[Second]:
        return iter(self.seconds)

    def __len__(self) -> int:
        return len(self.seconds)


# A second in a flat band is within FLAT_TOLERANCE of a level of at least MIN_OPS (or MIN_BYTES); a hair lower
# still, so that rounding never leaves out a second that _flat_band keeps.
BUSY_OPS = (1 - FLAT_TOLERANCE) * MIN_OPS * (1 - 1e-9)
BUSY_BYTES = (1 - FLAT_TOLERANCE) * MIN_BYTES * (1 - 1e-9)


def busy(second: Second, direction: str) -> bool:
    """Busy enough in this direction to sit in a flat band."""
    return second.ops[direction] >= BUSY_OPS or second.bytes[direction] >= BUSY_BYTES


_NOTHING = dict.fromkeys(DIRECTIONS, 0.0)
QUIET = Second(_NOTHING, _NOTHING, _NOTHING, dict.fromkeys(DIRECTIONS, math.nan))  # see second_between()


@dataclass
class DeviceState:
    """What the sampler keeps per device."""

    window: Window
    last: diskstats.DiskStats | None = None
    last_time: float = 0.0
    plateaus: dict[str, Plateau] = field(default_factory=dict)  # direction -> plateau
    throttled_seconds: dict[tuple[str, str], float] = field(default_factory=dict)  # (limit, direction)
    # (time, I/Os the device completed, of which probes): for the probes' share of the device's I/O
    completed_window: deque[tuple[float, int, int]] = field(default_factory=deque)
    check: Check | None = None  # the last active check's verdict
    checking: dict[str, float] | None = None  # direction -> ceiling, while a check runs
    checks: dict[str, int] = field(default_factory=dict)  # verdict -> how many
    unloaded: dict[str, float | None] = field(default_factory=dict)  # direction -> the last judge's
    limits: tuple[float | None, float | None] = (None, None)  # (ops/s, bytes/s) configured, as last asked
    inputs_at: float = -math.inf  # when unloaded and limits were last asked for


@dataclass(frozen=True)
class Check:
    """The verdict of an active check (volprobe.burst) on a plateau the probes could not judge."""

    verdict: str  # capped, uncapped or inconclusive
    at: float  # monotonic time
    levels: dict[str, float]  # direction -> the plateau's ops/s when the check was asked for

    def holds_for(self, direction: str, found: Candidate, now: float) -> bool:
        """Still the answer: recent enough, and the plateau is still at the level that was checked."""
        ttl = CHECK_TTL_S if self.verdict != "inconclusive" else CHECK_RETRY_S
        level = self.levels.get(direction)
        return now - self.at < ttl and level is not None and abs(found.ceiling_ops - level) <= CHECK_LEVEL * level


@dataclass(frozen=True)
class CheckRequest:
    """What the detector asks of an active check: the disk's total level before it (its bytes per op give the
    request size), and where to report the verdict (this detector, not one started since)."""

    disk: str
    ops_per_s: float
    bytes_per_s: float
    report: Callable[[str, str], None]
    stop: threading.Event


class ThrottleDetector:
    """Samples diskstats of the given devices in a background thread and keeps their plateau verdicts."""

    def __init__(
        self,
        devices: Callable[[], Set[str]],
        unloaded_latency: Callable[[str, str], float | None],
        limits: Callable[[str], tuple[float | None, float | None]],
        on_change: Callable[[str, bool], None],
        probe_completions: Callable[[str], int],
        proc_root: str | Path,
        sample_interval: float,
        window: float,
        request_check: Callable[[CheckRequest], None] | None = None,
    ) -> None:
        self.request_check = request_check  # runs an active check, then calls record_check()
        self.devices = devices
        self.unloaded_latency = unloaded_latency
        self.limits = limits
        self.on_change = on_change
        self.probe_completions = probe_completions
        self.proc_root = Path(proc_root)
        self._diskstats = diskstats.Reader(proc_root)  # held open by the sampler's thread, closed as it ends
        self.sample_interval = sample_interval
        self.window_samples = max(MIN_SAMPLES, round(window / sample_interval))
        self._states: dict[str, DeviceState] = {}
        self.stride = 1  # sample intervals until the next read: more than 1 only while every disk is idle
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="throttle detector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # also ends an active check under way
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        name_this_thread("vp throttle")
        # A failed sample is logged, counted and retried after a back-off: detection never ends silently.
        try:
            supervise.run("throttle", self._sample_forever, self._stop, "throttle sampling")
        finally:
            self._diskstats.close()

    def _sample_forever(self) -> None:
        next_time = time.monotonic()
        while not self._stop.is_set():
            self.sample(time.monotonic())
            next_time += self.sample_interval * self.stride
            delay = next_time - time.monotonic()
            if delay < 0:  # fell behind (suspend, overload): restart the schedule instead of catching up
                next_time, delay = time.monotonic(), 0
            self._stop.wait(delay)

    def sample(self, now: float) -> None:
        """Read diskstats once and update every watched device.

        The callbacks into the exporter (its devices, their probes' unloaded latency, limits and completions,
        and the verdict changes) run outside this detector's lock, so a scrape never waits behind them. The
        unloaded latency and limits are asked for only when the device's window may hold a plateau, or every
        INPUTS_EVERY_S: this thread is the only one that changes the states, so it reads them unlocked.

        A read planned to cover several intervals (stride) keeps that many QUIET seconds per disk; whether each
        disk was certainly idle through them decides the next stride, and a disk that was not brings the sampler
        back to a read every interval."""
        wanted = self.devices()
        stats = self._diskstats.read(wanted)
        present = [name for name in wanted if name in stats]
        planned, stride = self.stride, IDLE_STRIDE_MAX
        seconds: dict[str, Second | None] = {}
        covered: dict[str, int] = {}  # intervals kept as QUIET, for reads that covered several
        inputs: dict[str, tuple[dict[str, float | None], tuple[float | None, float | None]]] = {}
        for name in present:
            state = self._states.get(name)
            if state is not None and state.last is not None:
                current, elapsed = stats[name], now - state.last_time
                intervals = round(elapsed / self.sample_interval)
                if planned > 1 and intervals > 1:
                    idle = idle_between(state.last, current, self.sample_interval)
                    seconds[name] = None if idle is None else QUIET
                    covered[name] = intervals
                else:
                    seconds[name] = second_between(state.last, current, elapsed, quiet_if_idle=True)
                    idle = seconds[name] is QUIET
                next_stride = idle_stride(state.last, current, elapsed, self.sample_interval) if idle else 1
                stride = min(stride, next_stride)
            else:
                stride = 1  # a disk's first reading: nothing known of its rate yet
            if state is None or now - state.inputs_at >= INPUTS_EVERY_S or self._may_hold(state, seconds.get(name)):
                inputs[name] = ({d: self.unloaded_latency(name, d) for d in DIRECTIONS}, self.limits(name))
        completions = {name: self.probe_completions(name) for name in present}
        changed: list[tuple[str, bool]] = []
        checks: list[CheckRequest] = []
        with self._lock:
            for name in list(self._states):
                if name not in wanted:
                    del self._states[name]
            for name in present:
                current = stats[name]
                state = self._states.setdefault(name, DeviceState(Window(self.window_samples)))
                if name in inputs:
                    state.unloaded, state.limits = inputs[name]
                    state.inputs_at = now
                if state.last is not None:
                    second = seconds.get(name)
                    if second is None:
                        state.window.clear()
                    else:
                        for _ in range(min(covered.get(name, 1), self.window_samples)):
                            state.window.append(second)
                        # Neither a plateau to end nor a window that may hold one: nothing to judge.
                        judged = state.plateaus or state.window.may_hold_any()
                        elapsed = now - state.last_time
                        if judged and self._judge(name, state, now, elapsed, state.unloaded, state.limits, checks):
                            changed.append((name, bool(state.plateaus)))
                state.last, state.last_time = current, now
                completed = current.reads_completed + current.writes_completed
                state.completed_window.append((now, completed, completions[name]))
                while (
                    state.completed_window
                    and state.completed_window[0][0] < now - self.window_samples * self.sample_interval
                ):
                    state.completed_window.popleft()
                if state.plateaus or state.checking is not None or state.window.may_hold_any():
                    stride = 1  # a plateau to judge, or a window that may come to hold one: every interval
            self.stride = stride
        for name, throttled in changed:
            self.on_change(name, throttled)
        for request in checks:
            assert self.request_check is not None
            self.request_check(request)

    @staticmethod
    def _may_hold(state: DeviceState, second: Second | None) -> bool:
        """Whether the window, with this new second, may hold a plateau in some direction (or held one: its end
        is judged with fresh inputs too)."""
        return bool(state.plateaus) or state.checking is not None or state.window.may_hold_any(second)

    def _judge(
        self,
        name: str,
        state: DeviceState,
        now: float,
        elapsed: float,
        unloaded: dict[str, float | None],
        limits: tuple[float | None, float | None],
        checks: list[CheckRequest],
    ) -> bool:
        """Update the device's plateaus; True when it became throttled or stopped being throttled.

        A flat, queued window whose await the probes cannot call long (they never saw the disk unloaded, or
        saw it no faster) is settled by an active check: its verdict, while it holds, decides; without one,
        a check is requested (added to `checks`) and the window is not a plateau yet."""
        was_throttled = bool(state.plateaus)
        possible = [d for d in DIRECTIONS if state.window.may_hold_plateau(d)]
        seconds = list(state.window) if possible else []
        state.plateaus = {}
        state.unloaded = dict(unloaded)
        unsure: dict[str, float] = {}
        for direction in possible:
            found = candidate(seconds, direction)
            if found is None:
                continue
            if not waits_long(found, unloaded[direction]):
                check = state.check
                if check is None or not check.holds_for(direction, found, now):
                    unsure[direction] = found.ceiling_ops
                    continue
                if check.verdict != "capped":
                    continue
            plateau = plateau_of(seconds, direction, found, *limits)
            state.plateaus[direction] = plateau
            key = (plateau.limit, direction)
            state.throttled_seconds[key] = state.throttled_seconds.get(key, 0.0) + elapsed
        spaced = state.check is None or now - state.check.at >= CHECK_MIN_INTERVAL_S
        if unsure and spaced and state.checking is None and self.request_check is not None:
            recent = seconds[-5:]
            ops = statistics.median(s.ops["total"] for s in recent)
            rate = statistics.median(s.bytes["total"] for s in recent)
            state.checking = unsure
            checks.append(CheckRequest(name, ops, rate, self.record_check, self._stop))
            log.info(
                "%s: a flat plateau at %.0f ops/s with requests queueing, but no sign yet that they wait longer than "
                "on the unloaded disk (a cap) rather than meet steady demand: checking with a burst of reads",
                name,
                ops,
            )
        if bool(state.plateaus) == was_throttled:
            return False
        if state.plateaus:
            summary = ", ".join(
                f"{d} {p.limit} ceiling {p.ceiling_ops:.0f} ops/s {p.ceiling_bytes / 2**20:.1f} MiB/s"
                for d, p in state.plateaus.items()
            )
            log.warning("%s is throttled: %s", name, summary)
        else:
            log.info("%s is no longer throttled", name)
        return True

    def is_throttled(self, disk: str) -> bool:
        with self._lock:
            state = self._states.get(disk)
            return bool(state and state.plateaus)

    def record_check(self, disk: str, verdict: str) -> None:
        """The outcome of a requested active check; the next sample judges with it."""
        with self._lock:
            state = self._states.get(disk)
            if state is None or state.checking is None:
                return
            state.check = Check(verdict, time.monotonic(), state.checking)
            state.checking = None
            state.checks[verdict] = state.checks.get(verdict, 0) + 1

    def snapshot(self) -> dict[str, DeviceState]:
        """Copies of the per-device verdicts and counters, for scrapes: of the devices watched now (a device
        whose target went away leaves the exposition with it, not at the next sample)."""
        wanted = self.devices()  # outside the lock: a callback into the exporter
        with self._lock:
            return {
                name: replace(
                    s,
                    window=Window(0),
                    last=None,
                    plateaus=dict(s.plateaus),
                    throttled_seconds=dict(s.throttled_seconds),
                    completed_window=deque(s.completed_window),
                    checking=dict(s.checking) if s.checking else None,
                    checks=dict(s.checks),
                    unloaded=dict(s.unloaded),
                )
                for name, s in self._states.items()
                if name in wanted
            }

    def probe_share(self, name: str) -> float | None:
        """The share of the device's completed I/Os over the window that were volprobe's probes."""
        with self._lock:
            state = self._states.get(name)
            if state is None or len(state.completed_window) < 2:
                return None
            (_, device0, probes0), (_, device1, probes1) = state.completed_window[0], state.completed_window[-1]
        if device1 <= device0:
            return None
        return min(1.0, max(0.0, (probes1 - probes0) / (device1 - device0)))

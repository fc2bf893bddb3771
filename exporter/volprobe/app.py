"""The exporter's wiring: its flags, and an App that builds, starts, reloads and stops it.

App.build() checks everything a command line can get wrong (the configuration, the listen addresses, the web
config) and refuses it with ConfigError before anything runs. start() opens the listeners and starts the probes;
serve() answers HTTP; reload() reads the configuration file again (SIGHUP); stop() ends it all. main() is the
process around it: logging, the allocator, and the signal loop. Tests drive an App in-process.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from . import __version__, capabilities, mountcheck, privatemount, privileges, units, version
from .collectors import VolprobeCollector, add_flags, enabled_from_args
from .command import add_path_flags, host_from, report
from .config import Config, ConfigError, from_paths, load
from .exposition import utf8_text
from .logs import LOG_FORMATS, fields, problem_key, setup_logging
from .runtime import Exporter
from .server import (
    ExporterHTTPServer,
    address_text,
    connection_bound,
    landing_page,
    listen,
    parse_listen_address,
    raise_open_files_limit,
    systemd_sockets,
)
from .view import RuntimeView
from .webconfig import WebConfigWatcher

log = logging.getLogger("volprobe")
DEFAULT_LISTEN = ":10130"
LEFTOVER_WAIT_S = 2.0  # keep_privileges(): how long the mount checks of --target paths may take to end


def parser() -> argparse.ArgumentParser:
    """The exporter's flags (the tools have their own: volprobe.tools)."""
    parser = argparse.ArgumentParser(
        prog="volprobe",
        description="Prometheus exporter: queue-depth-1 direct I/O probes of block volumes. "
        "Subcommands: check-config, compare, devices, ping, warmup (volprobe SUBCOMMAND --help).",
    )
    parser.add_argument("--config", help="YAML configuration file (default: probe every whole disk, read-only)")
    parser.add_argument("--target", action="append", metavar="PATH", help="probe a device or directory (repeatable)")
    parser.add_argument(
        "--web.listen-address",
        dest="listen",
        action="append",
        help=f"address to listen on (repeatable: one server on each; default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--web.telemetry-path", dest="telemetry_path", default="/metrics", help="path of the metrics (default /metrics)"
    )
    parser.add_argument("--web.config.file", dest="web_config", help="exporter-toolkit web config (TLS, basic auth)")
    parser.add_argument(
        "--web.systemd-socket",
        dest="systemd_socket",
        action="store_true",
        help="serve on the sockets systemd passes (socket activation: LISTEN_FDS) instead of --web.listen-address",
    )
    parser.add_argument(
        "--web.max-requests",
        dest="max_requests",
        type=_non_negative,
        default=40,
        help="maximum number of parallel scrape requests (beyond it, 503); 0 disables the limit (default 40)",
    )
    parser.add_argument(
        "--web.disable-exporter-metrics",
        dest="disable_exporter_metrics",
        action="store_true",
        help="leave out the exporter's own process_* and python_info metrics",
    )
    parser.add_argument(
        "--nvme.provider-statistics",
        dest="provider_statistics",
        action="store_true",
        help="read the provider's statistics of AWS NVMe devices with the NVMe admin command: volprobe keeps "
        "CAP_SYS_ADMIN for it (else it drops it at start, with every capability its configuration does not use)",
    )
    parser.add_argument("--log.level", dest="log_level", default="info", choices=["debug", "info", "warn", "error"])
    parser.add_argument("--log.format", dest="log_format", default="logfmt", choices=sorted(LOG_FORMATS))
    parser.add_argument("--version", action=_VersionAction, help="show the version, commit and build, and exit")
    add_path_flags(parser)
    add_flags(parser)
    return parser


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


class _VersionAction(argparse.Action):
    """`--version`: node_exporter's lines (volprobe.version), made only when asked (they may ask git)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from .probe import TIMER

        sys.stdout.write(version.text(TIMER))
        parser.exit()


def limit_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives each thread that allocates its own malloc arena; with a thread per probe that is most of
    the exporter's memory. Two arenas serve a few dozen mostly idle threads just as well."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def build_registry(
    view: RuntimeView,
    enabled: Iterable[str] | None,
    procfs: str = "/proc",
    platform: object | None = None,
    clock: Callable[[], float] = time.perf_counter,
    exporter_metrics: bool = True,
) -> CollectorRegistry:
    """What /metrics exposes: the enabled collectors over `view`, then prometheus_client's process_* (from
    `procfs`) and python_info (of `platform`, the running interpreter's by default), unless `exporter_metrics`
    is False (--web.disable-exporter-metrics, as node_exporter's leaves out its go_* and process_*). `clock`
    times the collectors."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VolprobeCollector(view, enabled, clock))
    if exporter_metrics:
        ProcessCollector(registry=registry, proc=procfs)
        PlatformCollector(registry=registry, platform=platform)
    return registry


class ListenError(Exception):
    """An address could not be listened on (in use, not local): the exporter exits 1."""


def _socket_name(sock: socket.socket) -> str:
    try:
        name = sock.getsockname()
    except OSError:
        return f"fd {sock.fileno()}"
    return address_text(name)


def _load_config(args: argparse.Namespace) -> Config:
    if args.config and args.target:
        raise ConfigError(["--config and --target: give one or the other"])
    if args.config:
        return load(args.config)
    return from_paths(args.target or [], mountcheck.is_directory)


class App:
    """One exporter: its probes (Exporter), its registry and its HTTP servers, from parsed flags."""

    def __init__(
        self,
        args: argparse.Namespace,
        exporter: Exporter,
        web: WebConfigWatcher,
        addresses: list[tuple[str, tuple[str, int]]],
    ) -> None:
        self.args = args
        self.exporter = exporter
        self.web = web
        self.addresses = addresses  # (as given, parsed)
        self.registry = build_registry(
            exporter, enabled_from_args(args), args.procfs, exporter_metrics=not args.disable_exporter_metrics
        )
        self.servers: list[ExporterHTTPServer] = []
        self.listening = [text for text, _ in addresses]
        self.kept: privileges.Kept | None = None  # what keep_privileges() left the process, once it ran

    @classmethod
    def build(cls, args: argparse.Namespace) -> App:
        """Everything the flags name, checked: ConfigError (exit 2) if anything is refused. Nothing runs yet."""
        if not args.telemetry_path.startswith("/") or args.telemetry_path.startswith(("/-/", "//")):
            raise ConfigError([f"--web.telemetry-path: {args.telemetry_path!r} must start with / (not /-/)"])
        listen = args.listen or [DEFAULT_LISTEN]
        config = _load_config(args)
        try:
            addresses = [(text, parse_listen_address(text)) for text in listen]
        except ValueError as err:
            raise ConfigError([f"--web.listen-address: {err}"]) from None
        web = WebConfigWatcher(args.web_config)
        return cls(args, Exporter(config, host_from(args), web), web, addresses)

    def start(self, listening: Callable[[], None] | None = None) -> None:
        """Open every listener, then start the probes: ListenError or ConfigError, and nothing left open.
        `listening` is called between the two, while no thread of the exporter's runs yet (keep_privileges)."""
        raise_open_files_limit()  # connections cost a descriptor each, not a thread: room for thousands
        listeners: list[tuple[str, tuple[str, int] | socket.socket]] = list(self.addresses)
        if self.args.systemd_socket:  # node_exporter's --web.systemd-socket: the listen addresses are not used
            passed = systemd_sockets()
            if not passed:
                raise ListenError("--web.systemd-socket: systemd passed no socket (LISTEN_FDS, LISTEN_PID)")
            listeners = [(f"systemd socket {_socket_name(sock)}", sock) for sock in passed]
        self.listening = [text for text, _ in listeners]
        # The bound is the process's (its descriptors, its memory): each listener holds its share, so that whoever
        # fills every listener still leaves the probes their reserve of open files.
        share = max(1, connection_bound() // max(1, len(listeners)))
        # Bound first, then `listening`, then the servers, which start their threads.
        bound: list[tuple[str, socket.socket]] = []
        try:
            for text, address in listeners:
                try:
                    bound.append((text, address if isinstance(address, socket.socket) else listen(address)))
                except OSError as err:
                    raise ListenError(f"cannot listen on {text}: {err.strerror or err}") from None
            if listening is not None:
                listening()
        except BaseException:
            for _, sock in bound:
                sock.close()
            raise
        for index, (text, sock) in enumerate(bound):
            try:
                self.servers.append(
                    ExporterHTTPServer(
                        sock,
                        self.registry,
                        self.web,
                        self.landing,
                        self.args.telemetry_path,
                        max_requests=self.args.max_requests,
                        max_connections=share,
                    )
                )
            except OSError as err:
                self._close_servers()
                for _, rest in bound[index + 1 :]:
                    rest.close()
                raise ListenError(f"cannot listen on {text}: {err.strerror or err}") from None
        try:
            self.exporter.start()
        except ConfigError as err:
            self._close_servers()
            err.source = err.source or self.args.config  # its problems name keys of that file, if one is given
            raise
        capabilities.check_idle_io_priority(self.exporter.found)  # logged and exported now, not first at a warm-up
        if not self.exporter.probes.running() and self.exporter.config.discovery is None:
            log.warning("no targets: nothing to probe (give --config or --target)")

    def needed(self, config: Config) -> int:
        """The capabilities (a mask) `config` uses (privileges.needed)."""
        directories = any(target.directory for target in config.targets)
        return privileges.needed(bool(config.kubernetes.rules), self.args.provider_statistics, directories)

    def keep_privileges(self) -> None:
        """Drop every capability the configuration does not use, from every set, and set no_new_privs (volprobe.
        privileges): once the listeners are bound, before any thread starts. The process's, so main() only."""
        wanted = self.needed(self.exporter.config)
        # The only threads before this one: the mount checks of `--target` paths (mountcheck.is_directory), each a
        # stat in a thread of its own that ends once it returns. One still in the kernel (a hung mount) cannot be
        # narrowed from here: it keeps what it had until its stat returns, and then ends, which the log says.
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        others = [thread for thread in threading.enumerate() if thread is not threading.current_thread()]
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [thread.name for thread in others if thread.is_alive()]
        if hung:
            log.warning(
                "%s, hung in the kernel, keep the capabilities the process started with until they return (and "
                "end); every other thread has only what it keeps",
                ", ".join(hung),
            )
        while privileges.threads() > 1 + len(hung) and time.monotonic() < deadline:
            time.sleep(0.001)  # a joined thread's OS thread is gone a moment after join() returns
        kept = self.kept = privileges.keep_only(wanted, len(hung))
        self.exporter.found.kept = kept
        dropped = len(privileges.names(kept.held & ~kept.capabilities))
        log.info(
            "keeping capabilities: %s (dropped %d others from every set%s; no_new_privs %d)",
            kept.text,
            dropped,
            ", the bounding set included" if kept.bounded else "; the bounding set unchanged, without CAP_SETPCAP",
            int(kept.no_new_privs),
        )
        # CAP_DAC_OVERRIDE is for other users' directories only: an unprivileged user (the unit's, the pod's)
        # writes where its permissions let it, and is told so by the target it cannot prepare.
        missing = kept.missing & ~privileges.mask([privileges.CAP_DAC_OVERRIDE])
        if missing:
            log.warning(
                "the configuration uses %s, which the process was not given (kubernetes.rules: private mount "
                "copies; --nvme.provider-statistics: the NVMe admin command); it falls back without",
                ", ".join(privileges.names(missing)),
            )

    def serve(self) -> None:
        """Answer HTTP on every listener, each in its own thread."""
        for server in self.servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            server.ready.set()
        listen = ", ".join(self.listening)
        log.info(
            "volprobe %s listening on %s (%d probes; at most %d connections)",
            __version__,
            listen,
            len(self.exporter.probes.running()),
            sum(server.max_connections for server in self.servers),
        )

    def landing(self) -> str:
        resolved = self.exporter.probes.targets()
        return landing_page(
            [
                (
                    utf8_text(t.name),
                    utf8_text(t.path),  # a path may hold a byte that is not UTF-8
                    t.device_name or "-",
                    ", ".join(f"{p.op} {units.format_size(p.block_size)}" for p in t.probes),
                )
                for t in resolved
            ],
            self.args.telemetry_path,
        )

    def reload(self) -> None:
        """SIGHUP: read the configuration again and apply it; a bad one is logged and the running one kept."""
        path = self.args.config
        if not path:
            log.warning("SIGHUP: no --config file to reload (targets came from the command line or the default)")
            return
        log.info("SIGHUP: reloading %s", path)
        try:
            config = load(path)  # raises ConfigError alone, whatever the file holds
        except ConfigError as err:
            self.exporter.note_reload(False)
            _log_rejected(path, err)
            return
        except Exception as err:  # should load() ever let another through: refused, as any bad file is
            self.exporter.note_reload(False)
            _log_rejected(path, ConfigError([f"{path}: cannot be loaded: {err!r}"[:300]]))
            return
        self._note_dropped(config)
        try:
            self.exporter.reload(config)  # records its own outcome
        except ConfigError as err:
            _log_rejected(path, err)
        except Exception:  # a bug must not end the exporter: it keeps serving what it had
            self.exporter.note_reload(False)
            log.exception("reloading %s failed; the running configuration is kept", path)

    def _note_dropped(self, config: Config) -> None:
        """A reloaded configuration that uses a capability dropped at start cannot have it back: said, and
        exported (its feature's volprobe_capability_available 0), never silently. Restarting gives it back."""
        if self.kept is None:
            return
        lacking = self.needed(config) & self.kept.held & ~self.kept.capabilities  # held at start, then dropped
        admin = privileges.mask([privileges.CAP_SYS_ADMIN])
        if lacking & admin and config.kubernetes.rules:
            why = (
                "kubernetes.rules need CAP_SYS_ADMIN (private mount copies), dropped at start when no rule was "
                "configured; restart volprobe to have it. Pod volumes are opened at their path"
            )
            log.warning("SIGHUP: %s", why)
            self.exporter.found.record(privatemount.PRIVATE_MOUNT, False, why)
        if lacking & privileges.mask([privileges.CAP_DAC_OVERRIDE]):
            log.warning(
                "SIGHUP: directory targets use CAP_DAC_OVERRIDE (another user's directories), dropped at start when "
                "none was configured; a directory root may not write in is refused until volprobe restarts"
            )

    def stop(self) -> list[str]:
        """Stop the probes, then the servers; return the probes still stuck in the kernel."""
        stuck = self.exporter.stop()
        for server in self.servers:
            server.shutdown()
        self._close_servers()
        return stuck

    def _close_servers(self) -> None:
        for server in self.servers:
            server.server_close()
        self.servers = []


def _log_rejected(path: str, err: ConfigError) -> None:
    """A refused configuration: each problem a line of its own, its key (when it names one) a field."""
    for problem in err.problems:
        where = fields(path=path, key=problem_key(problem.removeprefix(f"{path}: ")))  # a YAML-level one names both
        log.error("configuration %s rejected, keeping the running one: %s", path, problem, extra=where)


def run_until_signalled(app: App) -> None:
    """Serve until SIGTERM or SIGINT; SIGHUP reloads, on the main thread, one request at a time.

    The signals reach this loop through a socket that CPython's own C-level handler writes each signal's number
    to (signal.set_wakeup_fd), whichever thread the kernel delivered it to. A Python-level handler that sets an
    Event is not enough: it runs only when the main thread next runs bytecode, so a SIGHUP that lands just
    before the main thread blocks (likely right after start, on a loaded machine) was never acted on.
    """
    receive, send = socket.socketpair()
    send.setblocking(False)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _noted)
    previous = signal.set_wakeup_fd(send.fileno(), warn_on_full_buffer=False)
    try:
        app.serve()
        while True:
            # What arrived together is handled together: a stop wins over reloads, and reloads in a row are one.
            pending = [signal.Signals(number) for number in receive.recv(64)]
            stops = [sig.name for sig in pending if sig != signal.SIGHUP]
            if stops:
                log.info("received %s, shutting down", stops[0])
                return
            app.reload()
    finally:
        signal.set_wakeup_fd(previous)
        receive.close()
        send.close()


def _noted(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler does nothing: installing it makes the C-level one write to the wakeup socket
    (and keeps the default action, termination, away)."""


def main(argv: Sequence[str]) -> int:
    """`volprobe [FLAGS]`: the exporter, until SIGTERM. Exit 2 on a refused configuration, 1 if it cannot listen."""
    args = parser().parse_args(argv)
    setup_logging("warning" if args.log_level == "warn" else args.log_level, args.log_format)
    limit_malloc_arenas()
    try:
        app = App.build(args)
        app.start(app.keep_privileges)
    except ConfigError as err:
        return report(err)
    except ListenError as err:
        log.error("%s", err)
        return 1
    # What start-up made lives as long as the process: the cyclic collector need not walk it on every full
    # collection (these landed in the middle of scrapes, doubling their p99; bench/series).
    gc.freeze()
    run_until_signalled(app)
    stuck = app.stop()
    if stuck:
        log.warning("probes still blocked in the kernel at exit: %s", ", ".join(stuck))
    return 0

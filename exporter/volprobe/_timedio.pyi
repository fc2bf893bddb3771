# The C timer (_timedio.c): timer.py's Timer, made without the interpreter.
import array
import mmap

RUN_DONE: int
RUN_STOPPED: int
RUN_OPEN_FAILED: int
RUN_IO_FAILED: int
RUN_SHORT: int

class Loop:
    def __init__(
        self,
        path: str,
        flags: int,
        buffer: mmap.mmap | bytearray,
        inflight: array.array[int] | bytearray,
        syscall: str,
        writes: bool,
        jitter: float,
        seed: int,
        counter: int,
    ) -> None: ...
    @property
    def counter(self) -> int: ...
    @property
    def completed(self) -> int: ...
    @property
    def missed(self) -> int: ...
    @property
    def zero_reads(self) -> int: ...
    @property
    def deadline_ns(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    def run(self, offsets: array.array[int], fd: int) -> tuple[int, int, int, int]: ...
    def take(self) -> list[tuple[int, int, int, bool]]: ...
    def schedule(self, start_ns: int, interval_ns: int) -> None: ...
    def set_interval(self, interval_ns: int) -> None: ...
    def stop(self) -> None: ...

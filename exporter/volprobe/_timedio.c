/*
 * A probe's paced loop in C: one direct I/O request after another (or a buffered commit, or a metadata
 * sequence: see REQUESTS), each timed by CLOCK_MONOTONIC read immediately before and after its syscalls and
 * around nothing else, without the interpreter. This keeps the
 * interpreter (its argument handling, the GIL hand-off, a cold code path after an idle interval) out of the
 * measurement, as fio's C loop does. volprobe falls back to timer.py's PythonTimer when this could not be built.
 *
 * Loop: a probe worker's whole paced loop, for a batch of offsets at a time. A paced probe's cost is its
 *   wake-up: Python woken cold once a second spends about 200 us of CPU where fio's C loop spends its syscalls.
 *   Loop.run() does, per offset: wait for the slot's deadline (on a futex, which stop and slow-down requests
 *   wake), stamp the write buffer, open (fd -1: the device is not held open between probes), the timed request,
 *   close, the all-zero check, the pacing (slots passed are skipped and counted, never replayed); and keeps each
 *   result for take(). It returns at the end of the batch, at stop, or at the first failure, which Python
 *   handles (errors, back-off, reopen). Its interface is timer.py's Timer.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <linux/fs.h>
#include <linux/futex.h>
#include <limits.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>

static long long ns(const struct timespec *t) { return (long long)t->tv_sec * 1000000000LL + t->tv_nsec; }

/* The requests a probe can make, by the name ops.py gives in its `syscall` column (timer.py's REQUESTS has the
 * same): each moves the whole buffer at offset and returns what pread and pwrite return. A request of several
 * steps (ops.py's `steps`) writes each step's nanoseconds to steps[], which the loop counts only when the whole
 * request succeeded. A zero-length buffer does nothing for the requests of several syscalls (timer.py's warm-up
 * call). */
#define MAX_STEPS 8
typedef ssize_t (*request_fn)(int fd, void *buf, size_t size, off_t offset, long long *steps);
static ssize_t request_pread(int fd, void *buf, size_t size, off_t offset, long long *steps) {
    (void)steps;
    return pread(fd, buf, size, offset);
}
static ssize_t request_pwrite(int fd, void *buf, size_t size, off_t offset, long long *steps) {
    (void)steps;
    return pwrite(fd, buf, size, offset);
}
/* A commit: a buffered write of one record at the log's next offset, then fdatasync, as etcd's WAL and fio's
 * --fdatasync=1 do. A short write is returned as it is (the probe reports SHORT), without the sync. */
static ssize_t request_pwrite_fdatasync(int fd, void *buf, size_t size, off_t offset, long long *steps) {
    (void)steps;
    if (size == 0)
        return 0;
    ssize_t moved = pwrite(fd, buf, size, offset);
    if (moved == (ssize_t)size && fdatasync(fd) < 0)
        return -1;
    return moved;
}

/* The metadata sequence, in the directory volprobe owns (fd; metadata.py makes and judges it, and clears what a
 * killed sequence left at start): create, write, fsync, rename, fsync the directory, unlink. Its two names are
 * METADATA_NEW and METADATA_RENAMED followed by ".<16 hex digits>", drawn anew for every sequence (timer.py's
 * metadata_names()), so a name planted beforehand is never the one used.
 *
 * The directory's mode keeps out every user but root, and a root tenant of the volume (a pod's root) can still put
 * any name in it: so nothing here opens or replaces a name it did not create in this very sequence. The file is
 * created O_EXCL|O_NOFOLLOW (EEXIST: something is there; nothing was opened) and written only through its
 * descriptor; the rename never replaces (RENAME_NOREPLACE: EEXIST when a name was planted there meanwhile, and
 * the file just made is removed). A filesystem without RENAME_NOREPLACE (EINVAL: NFS, some FUSE) gets a plain
 * rename: it can only replace a directory entry, never write into what the entry led to. */
#define METADATA_NEW "volprobe.new"
#define METADATA_RENAMED "volprobe.renamed"
#define METADATA_SUFFIX_HEX 16
#define METADATA_NAME_MAX 64
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE 1
#endif
/* The next sequence's names, drawn by request_one before it starts the clock (getrandom is no part of what a
 * sequence measures), in the thread that then makes the request. */
static __thread char metadata_made[METADATA_NAME_MAX], metadata_renamed[METADATA_NAME_MAX];
static int metadata_names(char *made, char *renamed) { /* 0, or -1 with errno */
    unsigned char random[METADATA_SUFFIX_HEX / 2];
    char hex[METADATA_SUFFIX_HEX + 1];
    if (syscall(SYS_getrandom, random, sizeof(random), 0) != (long)sizeof(random))
        return -1;
    for (size_t k = 0; k < sizeof(random); k++)
        snprintf(hex + 2 * k, 3, "%02x", random[k]);
    snprintf(made, METADATA_NAME_MAX, "%s.%s", METADATA_NEW, hex);
    snprintf(renamed, METADATA_NAME_MAX, "%s.%s", METADATA_RENAMED, hex);
    return 0;
}
static ssize_t request_metadata(int dir, void *buf, size_t size, off_t offset, long long *steps) {
    (void)offset;
    if (size == 0)
        return 0;
    const char *made = metadata_made, *renamed = metadata_renamed;
    long long at[7];
    struct timespec t;
    int saved;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[0] = ns(&t);
    int fd = openat(dir, made, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[1] = ns(&t);
    ssize_t moved = write(fd, buf, size);
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[2] = ns(&t);
    if (moved != (ssize_t)size || fsync(fd) < 0) {
        saved = errno;
        close(fd);
        unlinkat(dir, made, 0);
        errno = saved;
        return moved != (ssize_t)size ? moved : -1;
    }
    close(fd);
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[3] = ns(&t);
    int renamed_ok = (int)syscall(SYS_renameat2, dir, made, dir, renamed, RENAME_NOREPLACE);
    if (renamed_ok < 0 && errno == EINVAL)
        renamed_ok = renameat(dir, made, dir, renamed);
    if (renamed_ok < 0) {
        saved = errno;
        unlinkat(dir, made, 0);
        errno = saved;
        return -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[4] = ns(&t);
    if (fsync(dir) < 0) {
        saved = errno;
        unlinkat(dir, renamed, 0);
        errno = saved;
        return -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[5] = ns(&t);
    if (unlinkat(dir, renamed, 0) < 0)
        return -1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[6] = ns(&t);
    for (int k = 0; k < 6; k++)
        steps[k] = at[k + 1] - at[k];
    return moved;
}
static const struct {
    const char *name;
    request_fn request;
} REQUESTS[] = {
    {"pread", request_pread},
    {"pwrite", request_pwrite},
    {"pwrite_fdatasync", request_pwrite_fdatasync},
    {"metadata", request_metadata},
};

/* -- Loop --------------------------------------------------------------------------------------------- */

enum { RUN_DONE, RUN_STOPPED, RUN_OPEN_FAILED, RUN_IO_FAILED, RUN_SHORT, RUN_CHANGED };

/* What a held descriptor's safety checks (Python's, made on the descriptor) depend on and can change under it:
 * its identity, type, mode and owner; a regular file's links and size; a block device's size. Not the times,
 * which every write moves, nor a directory's size and links, which its own probe's files move. */
typedef struct {
    unsigned long long dev, ino, rdev, size;
    unsigned long long mode, uid, gid, nlink;
} Pin;

static int fingerprint(int fd, Pin *pin) { /* 0, or -1 with errno */
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -1;
    memset(pin, 0, sizeof(*pin));
    pin->dev = st.st_dev;
    pin->ino = st.st_ino;
    pin->mode = st.st_mode;
    pin->uid = st.st_uid;
    pin->gid = st.st_gid;
    if (S_ISREG(st.st_mode)) {
        pin->nlink = st.st_nlink;
        pin->size = (unsigned long long)st.st_size;
    } else if (S_ISBLK(st.st_mode)) {
        uint64_t bytes;
        if (ioctl(fd, BLKGETSIZE64, &bytes) != 0)
            return -1;
        pin->rdev = st.st_rdev;
        pin->size = bytes;
    }
    return 0;
}

typedef struct {
    PyObject_HEAD
    char *path;
    int flags, writes; /* writes: stamp the buffer before each request; reads: check it for zeros after */
    request_fn request;
    unsigned wake_word; /* bumped (and the futex woken) by stop() and set_interval() */
    Py_buffer buffer, inflight; /* held for the object's life */
    /* the schedule: slot k is due at start + k * interval (+ jitter); touched only with the GIL held or by run() */
    long long interval_ns, start_ns, slot, deadline_ns;
    double jitter;
    uint64_t rng, counter;
    /* set by other threads */
    volatile long long pending_interval_ns; /* 0: none */
    volatile int stopping;
    /* read by other threads */
    volatile long long completed, missed, zero_reads;
    /* per step of a request of several, added with its result (under mutex); taken_step_ns: those of the results
     * take() has returned, so that a scrape's steps and its latency histogram hold the same requests */
    long long step_ns[MAX_STEPS], taken_step_ns[MAX_STEPS];
    int nsteps;
    /* pin(): the held descriptor as Python last checked it; run() compares it again before a request once
     * recheck_ns have passed since checked_ns. Touched by run()'s requests, or by pin() between runs. */
    Pin pin;
    int pinned;
    long long recheck_ns, checked_ns;
    /* results of the current run, index = position in its batch; guarded by mutex */
    pthread_mutex_t mutex;
    long long *latency_ns, *end_ns;
    unsigned char *zero;
    Py_ssize_t capacity, produced, taken;
    /* With the engine (see Engine below; NULL when run() makes its requests in the caller's thread): the run in
     * progress, guarded by the engine's mutex. done_word: set to 1 (and woken) when the run ended. */
    int engine;
    const long long *offsets;
    Py_ssize_t count, next;
    int fd, listed, busy, status, error;
    ssize_t moved;
    unsigned done_word;
} Loop;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return ns(&t);
}

static double uniform(Loop *self) { /* xorshift64*: the jitter needs speed, not quality */
    self->rng ^= self->rng >> 12;
    self->rng ^= self->rng << 25;
    self->rng ^= self->rng >> 27;
    return (double)((self->rng * 0x2545F4914F6CDD1DULL) >> 11) / 9007199254740992.0;
}

/* The engine's probes share their slots (see Engine): a run's schedule starts at the next multiple of its grain
 * (its interval, at most 1 s) of CLOCK_MONOTONIC, and the jitter of a slot is drawn from the slot's time and the
 * interval, with the process's seed, so probes of one interval due at the same time stay together. Each probe's
 * own delays are as random as before: uniform in [0, jitter * interval), drawn anew for every slot. */
#define GRAIN_NS 1000000000LL
static uint64_t shared_seed;

static double shared_uniform(long long nominal_ns, long long interval_ns) { /* splitmix64's finaliser */
    uint64_t z = shared_seed ^ ((uint64_t)nominal_ns * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)interval_ns << 1);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0;
}

static void set_deadline(Loop *self) {
    long long nominal = self->start_ns + self->slot * self->interval_ns;
    double draw = self->jitter <= 0 ? 0 : self->engine ? shared_uniform(nominal, self->interval_ns) : uniform(self);
    self->deadline_ns = nominal + (long long)(draw * self->jitter * (double)self->interval_ns);
}

static void schedule(Loop *self, long long start_ns, long long interval_ns) {
    self->interval_ns = interval_ns > 0 ? interval_ns : 1;
    if (self->engine) {
        long long grain = self->interval_ns < GRAIN_NS ? self->interval_ns : GRAIN_NS;
        start_ns = (start_ns + grain - 1) / grain * grain;
    }
    self->start_ns = start_ns;
    self->slot = 0;
    set_deadline(self);
}

static void advance(Loop *self, long long now) { /* to the next slot not yet started; the passed ones are missed */
    long long due = (now - self->start_ns) / self->interval_ns + 1;
    long long next = self->slot + 1 > due ? self->slot + 1 : due;
    self->missed += next - (self->slot + 1);
    self->slot = next;
    set_deadline(self);
}

static void stamp(Loop *self) { /* a never-repeating counter, little-endian, at the head of every sector */
    unsigned char bytes[8];
    uint64_t value = ++self->counter;
    for (int i = 0; i < 8; i++)
        bytes[i] = (unsigned char)(value >> (8 * i));
    for (Py_ssize_t at = 0; at + 8 <= self->buffer.len; at += 512)
        memcpy((char *)self->buffer.buf + at, bytes, 8);
}

static int all_zero(const unsigned char *p, Py_ssize_t n) { return n == 0 || (p[0] == 0 && memcmp(p, p + 1, (size_t)n - 1) == 0); }

/* Wait for the deadline; 0 when due, 1 when asked to stop. A slow-down request restarts the schedule from now.
 * A futex rather than poll() on an eventfd: the cheapest sleep that another thread can cut short. */
static int wait_deadline(Loop *self) {
    for (;;) {
        unsigned seen = __atomic_load_n(&self->wake_word, __ATOMIC_ACQUIRE);
        if (self->stopping)
            return 1;
        long long requested = __atomic_exchange_n(&self->pending_interval_ns, 0, __ATOMIC_ACQ_REL);
        long long now = now_ns();
        if (requested > 0)
            schedule(self, now, requested);
        if (self->deadline_ns <= now)
            return 0;
        /* FUTEX_WAIT_BITSET takes an absolute CLOCK_MONOTONIC time; it returns at once if the word moved. */
        struct timespec until = {self->deadline_ns / 1000000000LL, self->deadline_ns % 1000000000LL};
        syscall(SYS_futex, &self->wake_word, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, seen, &until, NULL,
                FUTEX_BITSET_MATCH_ANY);
    }
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path",   "flags",  "buffer", "inflight", "syscall", "writes",
                             "jitter", "seed",   "counter", "steps",   "engine",  NULL};
    PyObject *path; /* bytes: the str's file system encoding, surrogates (undecodable bytes) included */
    const char *syscall;
    unsigned long long seed, counter;
    if (self->path != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Loop is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&iw*w*spdKK|ip", kwlist, PyUnicode_FSConverter, &path,
                                     &self->flags, &self->buffer, &self->inflight, &syscall, &self->writes,
                                     &self->jitter, &seed, &counter, &self->nsteps, &self->engine))
        return -1;
    self->path = strdup(PyBytes_AS_STRING(path));
    Py_DECREF(path);
    if (self->path == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (self->nsteps < 0 || self->nsteps > MAX_STEPS) {
        PyErr_Format(PyExc_ValueError, "steps must be in 0..%d", MAX_STEPS);
        return -1;
    }
    for (size_t k = 0; k < sizeof(REQUESTS) / sizeof(REQUESTS[0]); k++)
        if (strcmp(REQUESTS[k].name, syscall) == 0)
            self->request = REQUESTS[k].request;
    if (self->request == NULL) {
        PyErr_Format(PyExc_ValueError, "unknown syscall %s", syscall);
        return -1;
    }
    if (self->inflight.len < (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "inflight must hold 8 bytes");
        return -1;
    }
    self->rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
    self->counter = counter;
    schedule(self, now_ns(), 1000000000LL);
    return 0;
}

static PyObject *Loop_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Loop *self = (Loop *)type->tp_alloc(type, 0);
    if (self != NULL)
        pthread_mutex_init(&self->mutex, NULL);
    return (PyObject *)self;
}

static void Loop_dealloc(Loop *self) {
    if (self->buffer.obj != NULL)
        PyBuffer_Release(&self->buffer);
    if (self->inflight.obj != NULL)
        PyBuffer_Release(&self->inflight);
    free(self->path);
    free(self->latency_ns);
    free(self->end_ns);
    free(self->zero);
    pthread_mutex_destroy(&self->mutex);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Loop_schedule(Loop *self, PyObject *args) {
    long long start, interval;
    if (!PyArg_ParseTuple(args, "LL", &start, &interval))
        return NULL;
    schedule(self, start, interval);
    Py_RETURN_NONE;
}

static void futex_wake_all(unsigned *word) {
    syscall(SYS_futex, word, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
}

static void wake(Loop *self) {
    __atomic_add_fetch(&self->wake_word, 1, __ATOMIC_RELEASE);
    futex_wake_all(&self->wake_word);
}

/* One request at offsets[index] (fd, or the path opened for it when fd is -1), timed around its syscalls alone,
 * its result kept at index for take(): RUN_DONE when it succeeded, else how it failed (error, moved). Called
 * without the GIL, by the caller's thread (run() without the engine) or an engine thread. */
static int request_one(Loop *self, long long offset, int fd, Py_ssize_t index, int *error, ssize_t *moved) {
    volatile long long *marker = (volatile long long *)self->inflight.buf;
    size_t size = (size_t)self->buffer.len;
    if (self->writes)
        stamp(self);
    int use = fd;
    if (fd < 0 && (use = open(self->path, self->flags | O_CLOEXEC)) < 0) {
        *error = errno;
        return RUN_OPEN_FAILED;
    }
    if (self->request == request_metadata && metadata_names(metadata_made, metadata_renamed) < 0) {
        *error = errno;
        if (fd < 0)
            close(use);
        return RUN_IO_FAILED;
    }
    struct timespec start, end;
    long long steps[MAX_STEPS] = {0};
    clock_gettime(CLOCK_MONOTONIC, &start);
    *marker = ns(&start);
    *moved = self->request(use, self->buffer.buf, size, offset, steps);
    clock_gettime(CLOCK_MONOTONIC, &end);
    *marker = 0;
    if (*moved < 0)
        *error = errno;
    if (fd < 0)
        close(use);
    if (*moved < 0 || (size_t)*moved != size)
        return *moved < 0 ? RUN_IO_FAILED : RUN_SHORT;
    int zero = !self->writes && all_zero(self->buffer.buf, self->buffer.len);
    pthread_mutex_lock(&self->mutex);
    self->latency_ns[index] = ns(&end) - ns(&start);
    self->end_ns[index] = ns(&end);
    self->zero[index] = (unsigned char)zero;
    for (int k = 0; k < self->nsteps; k++)
        self->step_ns[k] += steps[k];
    self->produced = index + 1;
    pthread_mutex_unlock(&self->mutex);
    __atomic_add_fetch(&self->completed, 1, __ATOMIC_RELAXED);
    if (zero)
        __atomic_add_fetch(&self->zero_reads, 1, __ATOMIC_RELAXED);
    return RUN_DONE;
}

/* Before a request on a held descriptor: RUN_DONE when it was not due for its re-check or is as pinned, else
 * RUN_CHANGED (error: fstat's errno, or 0): the run ends before the request, and Python checks it all again. */
static int recheck(Loop *self, int fd, long long now, int *error) {
    if (fd < 0 || !self->pinned || self->recheck_ns <= 0 || now - self->checked_ns < self->recheck_ns)
        return RUN_DONE;
    volatile long long *marker = (volatile long long *)self->inflight.buf;
    *marker = now_ns(); /* in flight: an fstat on a hung server hangs as a request would, and shows as one */
    Pin found;
    int failed = fingerprint(fd, &found);
    *error = failed ? errno : 0;
    *marker = 0;
    if (failed || memcmp(&found, &self->pin, sizeof(found)) != 0)
        return RUN_CHANGED;
    self->checked_ns = now;
    return RUN_DONE;
}

/* -- Engine -------------------------------------------------------------------------------------------
 *
 * The probes of the process share one schedule: each Loop made with engine=True hands its run() to the engine and
 * its Python thread sleeps until the run ends (its batch done, stop, a failure or a change found by a re-check),
 * about every 5 minutes. The engine's leader thread sleeps until the earliest deadline of all the runs in progress
 * (with the timer slack of the shortest interval: 1%, at most 10 ms), then makes every request that is due, one
 * after the other, in that one wake-up: a wake-up from idle costs more than the request on a VM, and it is paid
 * once for the probes due together, not once each. Requests are still made one at a time, so two probes never meet
 * in flight.
 *
 * A request that does not come back (a stalled device) must not hold up the others. A watchdog timer (a timerfd)
 * is armed before each request, at the next other probe's deadline plus the grace (the slack, at least 1 ms), or
 * up to half a grace later: an arming still within that range is kept, so that the requests made one after the
 * other in a wake-up mostly share one. A second thread, the watcher, waits on it: when it fires with the leader
 * still in that request, the watcher becomes the leader and wakes a spare thread (or starts one) to be the new
 * watcher; the old leader records its request when it returns and then waits as the watcher, or as a spare (at
 * most MAX_PARKED), or ends. So there is one thread more than there are requests that outlived the grace, and
 * arming the watchdog costs a syscall for the first request of a wake-up and few of the others, and no wake-up.
 *
 * Probes of one interval share their slots (schedule(), set_deadline()): a slot's random delay is drawn once for
 * all of them, so they are due together and served in one wake-up, one after the other, however many volumes.
 */
#define MIN_GRACE_NS 1000000LL
#define MAX_PARKED 2
#define MAX_SLACK_NS 10000000LL
static struct {
    pthread_mutex_t mutex;
    unsigned wake_word;                /* the leader sleeps on it: bumped to wake it */
    Loop **loops;                      /* the runs in progress */
    Py_ssize_t nloops, capacity;
    int timerfd, started, failed;      /* failed: the threads could not be started (run() then makes its own) */
    unsigned long long generation;     /* bumped at each take-over: a thread leads while its copy matches */
    int has_leader, has_watcher, in_request;
    int need_watcher;                  /* a take-over could not start a new watcher */
    int parked;                        /* spare threads, waiting on park_word for the next take-over */
    unsigned park_word;
    long long armed_ns;                /* when the watchdog fires (CLOCK_MONOTONIC), 0 when disarmed */
    long long threads, takeovers;
} E = {.mutex = PTHREAD_MUTEX_INITIALIZER, .timerfd = -1};

static long long slack_of(const Loop *self) {
    long long slack = self->interval_ns / 100;
    return slack > MAX_SLACK_NS ? MAX_SLACK_NS : slack > 0 ? slack : 1;
}

static void arm(long long at) { /* engine mutex held; 0 disarms */
    if (at == E.armed_ns)
        return;
    struct itimerspec when = {{0, 0}, {at / 1000000000LL, at % 1000000000LL}};
    timerfd_settime(E.timerfd, TFD_TIMER_ABSTIME, &when, NULL);
    E.armed_ns = at;
}

/* While the leader is in a request (engine mutex held): the watchdog fires by `self`'s deadline plus its grace, if
 * it was not armed sooner, so that a run due meanwhile is served by a take-over should that request outlive it.
 * Wanted for a run that becomes servable while the leader is away: listed by run(), or settled by a displaced
 * leader (the leader had found it busy, so did not count it when it armed, or disarmed, the watchdog). */
static void cover(const Loop *self) {
    if (!E.in_request)
        return;
    long long grace = slack_of(self) > MIN_GRACE_NS ? slack_of(self) : MIN_GRACE_NS, now = now_ns();
    long long at = (self->deadline_ns > now ? self->deadline_ns : now) + grace;
    if (E.armed_ns == 0 || at < E.armed_ns)
        arm(at);
}

static void finish(Loop *self, int status) { /* engine mutex held: the run ends; its thread returns */
    for (Py_ssize_t k = 0; k < E.nloops; k++)
        if (E.loops[k] == self) {
            E.loops[k] = E.loops[--E.nloops];
            break;
        }
    self->listed = 0;
    self->status = status;
    __atomic_store_n(&self->done_word, 1, __ATOMIC_RELEASE);
    futex_wake_all(&self->done_word);
}

/* After a request of an engine run (engine mutex held): the run goes on at its next slot or ends. */
static void settle(Loop *self, int status, int error, ssize_t moved) {
    self->busy = 0;
    if (status != RUN_DONE) {
        self->error = error;
        self->moved = moved;
        finish(self, status);
        return;
    }
    self->next++;
    advance(self, now_ns()); /* to its next slot, as the loop without the engine does after every request */
    if (self->next == self->count)
        finish(self, RUN_DONE);
    else if (self->stopping)
        finish(self, RUN_STOPPED);
}

static int spawn(void);

/* The leader's loop (engine mutex held); returns, mutex held, once another thread took over. */
static void lead(void) {
    unsigned long long generation = E.generation;
    long long slack = -1;
    for (;;) {
        /* read before the scan: a set_interval() or a run listed after it makes the sleep below return at once */
        unsigned seen = __atomic_load_n(&E.wake_word, __ATOMIC_ACQUIRE);
        long long now = now_ns(), earliest = LLONG_MAX, other = LLONG_MAX, want = MAX_SLACK_NS;
        Loop *due = NULL;
        for (Py_ssize_t k = 0; k < E.nloops; k++) {
            Loop *loop = E.loops[k];
            if (loop->busy)
                continue;
            if (loop->stopping) {
                finish(loop, RUN_STOPPED);
                k--; /* the last run took its place */
                continue;
            }
            long long requested = __atomic_exchange_n(&loop->pending_interval_ns, 0, __ATOMIC_ACQ_REL);
            if (requested > 0)
                schedule(loop, now, requested);
            if (slack_of(loop) < want)
                want = slack_of(loop);
            if (loop->deadline_ns < earliest) {
                other = earliest;
                earliest = loop->deadline_ns;
                due = loop;
            } else if (loop->deadline_ns < other)
                other = loop->deadline_ns;
        }
        if (due == NULL || earliest > now) { /* sleep until the earliest deadline, or until woken */
            arm(0);
            pthread_mutex_unlock(&E.mutex);
            if (want != slack) /* the kernel may wake the leader this late: probes due close together share it */
                prctl(PR_SET_TIMERSLACK, (unsigned long)(slack = want), 0, 0, 0);
            struct timespec until = {earliest / 1000000000LL, earliest % 1000000000LL};
            syscall(SYS_futex, &E.wake_word, FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, seen,
                    earliest == LLONG_MAX ? NULL : &until, NULL, FUTEX_BITSET_MATCH_ANY);
            pthread_mutex_lock(&E.mutex);
            continue;
        }
        /* The request: the next probe due may wait for it up to the grace, then the watcher takes over. */
        if (E.need_watcher && spawn() == 0) /* none could be started at the last take-over: try again */
            E.need_watcher = 0;
        long long grace = want > MIN_GRACE_NS ? want : MIN_GRACE_NS;
        if (other == LLONG_MAX)
            arm(0);
        else { /* up to half a grace later than due, so that the requests made together share one arming */
            long long at = (other > now ? other : now) + grace;
            if (E.armed_ns < at || E.armed_ns > at + grace / 2)
                arm(at + grace / 2);
        }
        due->busy = 1;
        E.in_request = 1;
        Py_ssize_t index = due->next;
        long long offset = due->offsets[index];
        int fd = due->fd, error = 0;
        ssize_t moved = 0;
        pthread_mutex_unlock(&E.mutex);
        int status = recheck(due, fd, now, &error); /* an fstat, in the request's watch: it may hang too */
        if (status == RUN_DONE)
            status = request_one(due, offset, fd, index, &error, &moved);
        pthread_mutex_lock(&E.mutex);
        settle(due, status, error, moved);
        if (E.generation != generation) { /* displaced while in the request: the leader serves its loop again */
            if (due->listed) /* a leader now in a request of its own may have armed nothing for it */
                cover(due);
            __atomic_add_fetch(&E.wake_word, 1, __ATOMIC_RELEASE);
            futex_wake_all(&E.wake_word);
            return;
        }
        E.in_request = 0;
    }
}

static void *engine_thread(void *unused);

static int spawn(void) { /* engine mutex held */
    pthread_attr_t attr;
    pthread_t thread;
    sigset_t all, saved;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &saved); /* the new thread is born with every signal blocked: */
    pthread_attr_init(&attr);                   /* Python's signals go to Python's threads */
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024); /* no Python runs on it; a request's frames are small */
    int failed = pthread_create(&thread, &attr, engine_thread, NULL);
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &saved, NULL);
    if (!failed)
        E.threads++;
    return failed;
}

/* The watcher's wait (engine mutex held): returns, mutex held, when it has taken over and led until displaced. */
static void watch(void) {
    E.has_watcher = 1;
    E.need_watcher = 0;
    for (;;) {
        pthread_mutex_unlock(&E.mutex);
        uint64_t expirations;
        ssize_t got = read(E.timerfd, &expirations, sizeof(expirations));
        pthread_mutex_lock(&E.mutex);
        if (got != (ssize_t)sizeof(expirations) || !E.in_request || E.armed_ns == 0 || now_ns() < E.armed_ns)
            continue; /* a stale expiry (the request came back), or interrupted */
        E.generation++; /* the leader, still in its request, is displaced */
        E.takeovers++;
        E.in_request = 0;
        E.armed_ns = 0; /* it fired */
        E.has_watcher = 0;
        if (E.parked > 0) { /* a spare becomes the new watcher; else a new thread */
            __atomic_add_fetch(&E.park_word, 1, __ATOMIC_RELEASE);
            syscall(SYS_futex, &E.park_word, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, 1, NULL, NULL, 0);
        } else if (spawn() != 0)
            E.need_watcher = 1; /* the leader tries again before its next request (or a displaced one watches) */
        lead();
        return;
    }
}

static void *engine_thread(void *unused) {
    (void)unused;
    prctl(PR_SET_NAME, (unsigned long)"vp probes", 0, 0, 0);
    pthread_mutex_lock(&E.mutex);
    for (;;) {
        if (!E.has_leader) {
            E.has_leader = 1;
            lead();
        } else if (!E.has_watcher)
            watch();
        else if (E.parked < MAX_PARKED) { /* a displaced leader whose request came back: a spare */
            unsigned seen = __atomic_load_n(&E.park_word, __ATOMIC_ACQUIRE);
            E.parked++;
            pthread_mutex_unlock(&E.mutex);
            syscall(SYS_futex, &E.park_word, FUTEX_WAIT | FUTEX_PRIVATE_FLAG, seen, NULL, NULL, 0);
            pthread_mutex_lock(&E.mutex);
            E.parked--;
        } else
            break;
    }
    E.threads--;
    pthread_mutex_unlock(&E.mutex);
    return NULL;
}

static int engine_ready(void) { /* engine mutex held: the first run starts the leader and the watcher */
    if (!E.started && !E.failed) {
        E.timerfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
        if (E.timerfd < 0 || spawn() != 0 || spawn() != 0)
            E.failed = 1; /* a thread that did start leads, and only the runs in progress so far use it */
        E.started = 1;
    }
    return E.started && !E.failed;
}

static PyObject *Loop_set_interval(Loop *self, PyObject *args) {
    long long interval;
    if (!PyArg_ParseTuple(args, "L", &interval))
        return NULL;
    __atomic_store_n(&self->pending_interval_ns, interval > 0 ? interval : 1, __ATOMIC_RELEASE);
    wake(self);
    if (self->engine) {
        __atomic_add_fetch(&E.wake_word, 1, __ATOMIC_RELEASE);
        futex_wake_all(&E.wake_word);
    }
    Py_RETURN_NONE;
}

static PyObject *Loop_stop(Loop *self, PyObject *unused) {
    __atomic_store_n(&self->stopping, 1, __ATOMIC_RELEASE);
    wake(self);
    if (self->engine) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&E.mutex);
        if (self->listed && !self->busy) /* a request in flight ends the run when it returns */
            finish(self, RUN_STOPPED);
        pthread_mutex_unlock(&E.mutex);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* The run by the engine (GIL released): listed, then waited for. 1 if it ran, 0 if the engine is not there. */
static int run_by_engine(Loop *self, const long long *offsets, Py_ssize_t n, int fd) {
    pthread_mutex_lock(&E.mutex);
    if (!engine_ready()) {
        pthread_mutex_unlock(&E.mutex);
        return 0;
    }
    if (E.nloops == E.capacity) {
        Py_ssize_t capacity = E.capacity ? 2 * E.capacity : 64;
        Loop **loops = realloc(E.loops, (size_t)capacity * sizeof(Loop *));
        if (loops == NULL) {
            pthread_mutex_unlock(&E.mutex);
            return 0;
        }
        E.loops = loops;
        E.capacity = capacity;
    }
    self->offsets = offsets;
    self->count = n;
    self->next = 0;
    self->fd = fd;
    self->status = RUN_DONE;
    self->error = 0;
    self->moved = 0;
    self->busy = 0;
    __atomic_store_n(&self->done_word, 0, __ATOMIC_RELEASE);
    if (self->stopping)
        self->status = RUN_STOPPED;
    else if (n > 0) {
        E.loops[E.nloops++] = self;
        self->listed = 1;
        cover(self); /* the leader may be in a request: the watchdog serves this run too */
        __atomic_add_fetch(&E.wake_word, 1, __ATOMIC_RELEASE);
        futex_wake_all(&E.wake_word);
    }
    pthread_mutex_unlock(&E.mutex);
    if (self->status == RUN_STOPPED || n == 0)
        return 1;
    while (!__atomic_load_n(&self->done_word, __ATOMIC_ACQUIRE))
        syscall(SYS_futex, &self->done_word, FUTEX_WAIT | FUTEX_PRIVATE_FLAG, 0, NULL, NULL, 0);
    pthread_mutex_lock(&E.mutex); /* finish() is done with the loop once the mutex is free */
    pthread_mutex_unlock(&E.mutex);
    return 1;
}

/* run(offsets, fd, recheck_ns=0) -> (done, status, errno, bytes). offsets: a buffer of int64 byte offsets; fd:
 * a descriptor to use, or -1 to open the path for each request. done is the number of requests that succeeded;
 * on a failure, offsets[done] is the one that failed (status RUN_OPEN_FAILED, RUN_IO_FAILED with errno, or
 * RUN_SHORT with the bytes transferred), or was not made (RUN_CHANGED: the pinned descriptor changed, or
 * could not be looked at, at its re-check every recheck_ns). With the engine, its threads make the requests;
 * without, this one. */
static PyObject *Loop_run(Loop *self, PyObject *args) {
    Py_buffer offsets;
    int fd;
    long long recheck_ns = 0;
    if (!PyArg_ParseTuple(args, "y*i|L", &offsets, &fd, &recheck_ns))
        return NULL;
    self->recheck_ns = recheck_ns;
    Py_ssize_t n = offsets.len / (Py_ssize_t)sizeof(long long);
    pthread_mutex_lock(&self->mutex);
    if (n > self->capacity) {
        long long *latency = realloc(self->latency_ns, (size_t)n * sizeof(long long));
        if (latency != NULL)
            self->latency_ns = latency;
        long long *end = realloc(self->end_ns, (size_t)n * sizeof(long long));
        if (end != NULL)
            self->end_ns = end;
        unsigned char *zero = realloc(self->zero, (size_t)n);
        if (zero != NULL)
            self->zero = zero;
        if (latency == NULL || end == NULL || zero == NULL) {
            pthread_mutex_unlock(&self->mutex);
            PyBuffer_Release(&offsets);
            return PyErr_NoMemory();
        }
        self->capacity = n;
    }
    self->produced = self->taken = 0;
    /* results not taken are dropped with their steps, so that take() counts the steps of what it returns */
    memcpy(self->step_ns, self->taken_step_ns, sizeof(self->step_ns));
    pthread_mutex_unlock(&self->mutex);

    const long long *at = (const long long *)offsets.buf;
    Py_ssize_t i = 0;
    int status = RUN_DONE, error = 0, engined = 0;
    ssize_t moved = 0;
    Py_BEGIN_ALLOW_THREADS
    if (self->engine && (engined = run_by_engine(self, at, n, fd))) {
        i = self->next;
        status = self->status;
        error = self->error;
        moved = self->moved;
    }
    for (; !engined && i < n; i++) {
        if (wait_deadline(self)) {
            status = RUN_STOPPED;
            break;
        }
        if ((status = recheck(self, fd, now_ns(), &error)) != RUN_DONE)
            break;
        if ((status = request_one(self, at[i], fd, i, &error, &moved)) != RUN_DONE)
            break;
        advance(self, now_ns());
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&offsets);
    return Py_BuildValue("(niin)", i, status, error, (Py_ssize_t)(moved < 0 ? 0 : moved));
}

/* fingerprint() from Python (the GIL released: an fstat may hang): 0, or -1 with OSError set. */
static int fingerprint_or_raise(int fd, Pin *pin) {
    int failed;
    Py_BEGIN_ALLOW_THREADS
    failed = fingerprint(fd, pin);
    Py_END_ALLOW_THREADS
    if (failed)
        PyErr_SetFromErrno(PyExc_OSError);
    return failed ? -1 : 0;
}

/* pin(fd): fd as it is now is what run() re-checks it against (see Pin); called just before Python checks it, so
 * that a change made after that check is one the re-check sees. */
static PyObject *Loop_pin(Loop *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    self->pinned = 0;
    Pin pin;
    if (fingerprint_or_raise(fd, &pin) != 0)
        return NULL;
    self->pin = pin;
    self->pinned = 1;
    self->checked_ns = now_ns();
    Py_RETURN_NONE;
}

/* holds(fd) -> bool: whether fd is still as pinned (after Python's check: it did not change during it). */
static PyObject *Loop_holds(Loop *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd))
        return NULL;
    Pin found;
    if (fingerprint_or_raise(fd, &found) != 0)
        return NULL;
    return PyBool_FromLong(self->pinned && memcmp(&found, &self->pin, sizeof(found)) == 0);
}

/* engine() -> (threads, take-overs, runs in progress): for tests and the curious. */
static PyObject *engine_stats(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&E.mutex);
    PyObject *stats = Py_BuildValue("(LLn)", E.threads, E.takeovers, E.nloops);
    pthread_mutex_unlock(&E.mutex);
    return stats;
}

/* take() -> [(index, latency_ns, end_ns, zero)]: the results of the current run not taken yet. */
static PyObject *Loop_take(Loop *self, PyObject *unused) {
    pthread_mutex_lock(&self->mutex);
    Py_ssize_t from = self->taken, to = self->produced, count = to - from;
    long long *copy = count > 0 ? malloc((size_t)count * (2 * sizeof(long long) + 1)) : NULL;
    if (copy != NULL) {
        memcpy(copy, self->latency_ns + from, (size_t)count * sizeof(long long));
        memcpy(copy + count, self->end_ns + from, (size_t)count * sizeof(long long));
        memcpy((unsigned char *)(copy + 2 * count), self->zero + from, (size_t)count);
        self->taken = to;
    }
    if (count == 0 || copy != NULL) /* the steps of exactly the results returned */
        memcpy(self->taken_step_ns, self->step_ns, sizeof(self->step_ns));
    pthread_mutex_unlock(&self->mutex);
    if (count > 0 && copy == NULL)
        return PyErr_NoMemory();
    PyObject *list = PyList_New(count > 0 ? count : 0);
    for (Py_ssize_t k = 0; list != NULL && k < count; k++) {
        PyObject *item = Py_BuildValue("(nLLO)", from + k, copy[k], copy[count + k],
                                       ((unsigned char *)(copy + 2 * count))[k] ? Py_True : Py_False);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, k, item);
    }
    free(copy);
    return list;
}

static PyObject *Loop_counter(Loop *self, void *closure) { return PyLong_FromUnsignedLongLong(self->counter); }
static PyObject *Loop_completed(Loop *self, void *closure) { return PyLong_FromLongLong(self->completed); }
static PyObject *Loop_missed(Loop *self, void *closure) { return PyLong_FromLongLong(self->missed); }
static PyObject *Loop_zero_reads(Loop *self, void *closure) { return PyLong_FromLongLong(self->zero_reads); }
static PyObject *Loop_deadline(Loop *self, void *closure) { return PyLong_FromLongLong(self->deadline_ns); }
static PyObject *Loop_engine(Loop *self, void *closure) { return PyBool_FromLong(self->engine); }
static PyObject *Loop_max_batch(Loop *self, void *closure) { return PyLong_FromSsize_t(PY_SSIZE_T_MAX); }
static PyObject *Loop_steps(Loop *self, void *closure) {
    long long taken[MAX_STEPS];
    pthread_mutex_lock(&self->mutex);
    memcpy(taken, self->taken_step_ns, sizeof(taken));
    pthread_mutex_unlock(&self->mutex);
    PyObject *steps = PyTuple_New(self->nsteps);
    for (int k = 0; steps != NULL && k < self->nsteps; k++) {
        PyObject *value = PyLong_FromLongLong(taken[k]);
        if (value == NULL) {
            Py_CLEAR(steps);
            break;
        }
        PyTuple_SET_ITEM(steps, k, value);
    }
    return steps;
}

static PyGetSetDef Loop_getset[] = {
    {"counter", (getter)Loop_counter, NULL, "the last write stamp", NULL},
    {"completed", (getter)Loop_completed, NULL, "requests that succeeded, over all runs", NULL},
    {"missed", (getter)Loop_missed, NULL, "slots skipped because the previous request was still running", NULL},
    {"zero_reads", (getter)Loop_zero_reads, NULL, "reads that returned only zeros", NULL},
    {"deadline_ns", (getter)Loop_deadline, NULL, "when the next request is due (CLOCK_MONOTONIC)", NULL},
    {"engine", (getter)Loop_engine, NULL, "whether the probe engine makes the requests of run()", NULL},
    {"max_batch", (getter)Loop_max_batch, NULL, "the most offsets worth giving one run(): no limit", NULL},
    {"steps", (getter)Loop_steps, NULL, "nanoseconds in each step of the successful requests take() returned", NULL},
    {NULL},
};

static PyMethodDef Loop_methods[] = {
    {"run", (PyCFunction)Loop_run, METH_VARARGS, "run(offsets, fd, recheck_ns=0) -> (done, status, errno, bytes)"},
    {"pin", (PyCFunction)Loop_pin, METH_VARARGS, "pin(fd): what run() re-checks fd against"},
    {"holds", (PyCFunction)Loop_holds, METH_VARARGS, "holds(fd) -> whether fd is still as pinned"},
    {"take", (PyCFunction)Loop_take, METH_NOARGS, "take() -> [(index, latency_ns, end_ns, zero)]"},
    {"schedule", (PyCFunction)Loop_schedule, METH_VARARGS, "schedule(start_ns, interval_ns): slot 0 at start"},
    {"set_interval", (PyCFunction)Loop_set_interval, METH_VARARGS, "set_interval(ns): from any thread"},
    {"stop", (PyCFunction)Loop_stop, METH_NOARGS, "stop(): from any thread; a request in flight finishes"},
    {NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "volprobe._timedio.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A paced probe loop over batches of offsets (see the module comment).",
    .tp_new = Loop_new,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
    .tp_getset = Loop_getset,
};

static PyMethodDef methods[] = {
    {"engine", engine_stats, METH_NOARGS, "engine() -> (threads, take-overs, runs in progress)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_timedio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__timedio(void) {
    if (syscall(SYS_getrandom, &shared_seed, sizeof(shared_seed), 0) != (long)sizeof(shared_seed))
        shared_seed = (uint64_t)now_ns() * 0x9E3779B97F4A7C15ULL;
    if (PyType_Ready(&LoopType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        Py_DECREF(m);
        return NULL;
    }
    for (int k = RUN_DONE; k <= RUN_CHANGED; k++) {
        static const char *names[] = {"RUN_DONE",      "RUN_STOPPED", "RUN_OPEN_FAILED",
                                      "RUN_IO_FAILED", "RUN_SHORT",   "RUN_CHANGED"};
        if (PyModule_AddIntConstant(m, names[k], k) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}

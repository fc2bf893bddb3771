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
#include <string.h>
#include <linux/futex.h>
#include <limits.h>
#include <sys/syscall.h>
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

/* The metadata sequence, in the directory volprobe owns (fd; metadata.py makes and judges it, and clears these
 * two names, its only ones, at start): create, write, fsync, rename, fsync the directory, unlink. */
#define METADATA_NEW "volprobe.new"
#define METADATA_RENAMED "volprobe.renamed"
static ssize_t request_metadata(int dir, void *buf, size_t size, off_t offset, long long *steps) {
    (void)offset;
    if (size == 0)
        return 0;
    long long at[7];
    struct timespec t;
    int saved;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[0] = ns(&t);
    int fd = openat(dir, METADATA_NEW, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
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
        errno = saved;
        return moved != (ssize_t)size ? moved : -1;
    }
    close(fd);
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[3] = ns(&t);
    if (renameat(dir, METADATA_NEW, dir, METADATA_RENAMED) < 0)
        return -1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[4] = ns(&t);
    if (fsync(dir) < 0)
        return -1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    at[5] = ns(&t);
    if (unlinkat(dir, METADATA_RENAMED, 0) < 0)
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

enum { RUN_DONE, RUN_STOPPED, RUN_OPEN_FAILED, RUN_IO_FAILED, RUN_SHORT };

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
    /* results of the current run, index = position in its batch; guarded by mutex */
    pthread_mutex_t mutex;
    long long *latency_ns, *end_ns;
    unsigned char *zero;
    Py_ssize_t capacity, produced, taken;
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

static void set_deadline(Loop *self) {
    long long jitter = self->jitter > 0 ? (long long)(uniform(self) * self->jitter * (double)self->interval_ns) : 0;
    self->deadline_ns = self->start_ns + self->slot * self->interval_ns + jitter;
}

static void schedule(Loop *self, long long start_ns, long long interval_ns) {
    self->interval_ns = interval_ns > 0 ? interval_ns : 1;
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
    static char *kwlist[] = {"path",   "flags", "buffer",  "inflight", "syscall",
                             "writes", "jitter", "seed", "counter", "steps",    NULL};
    PyObject *path; /* bytes: the str's file system encoding, surrogates (undecodable bytes) included */
    const char *syscall;
    unsigned long long seed, counter;
    if (self->path != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Loop is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&iw*w*spdKK|i", kwlist, PyUnicode_FSConverter, &path,
                                     &self->flags, &self->buffer, &self->inflight, &syscall, &self->writes,
                                     &self->jitter, &seed, &counter, &self->nsteps))
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

static void wake(Loop *self) {
    __atomic_add_fetch(&self->wake_word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &self->wake_word, FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX, NULL, NULL, 0);
}

static PyObject *Loop_set_interval(Loop *self, PyObject *args) {
    long long interval;
    if (!PyArg_ParseTuple(args, "L", &interval))
        return NULL;
    __atomic_store_n(&self->pending_interval_ns, interval > 0 ? interval : 1, __ATOMIC_RELEASE);
    wake(self);
    Py_RETURN_NONE;
}

static PyObject *Loop_stop(Loop *self, PyObject *unused) {
    __atomic_store_n(&self->stopping, 1, __ATOMIC_RELEASE);
    wake(self);
    Py_RETURN_NONE;
}

/* run(offsets, fd) -> (done, status, errno, bytes). offsets: a buffer of int64 byte offsets; fd: a descriptor
 * to use, or -1 to open the path for each request. done is the number of requests that succeeded; on a
 * failure, offsets[done] is the one that failed (status RUN_OPEN_FAILED, RUN_IO_FAILED with errno, or
 * RUN_SHORT with the bytes transferred). */
static PyObject *Loop_run(Loop *self, PyObject *args) {
    Py_buffer offsets;
    int fd;
    if (!PyArg_ParseTuple(args, "y*i", &offsets, &fd))
        return NULL;
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
    volatile long long *marker = (volatile long long *)self->inflight.buf;
    size_t size = (size_t)self->buffer.len;
    Py_ssize_t i = 0;
    int status = RUN_DONE, error = 0;
    ssize_t moved = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; i < n; i++) {
        if (wait_deadline(self)) {
            status = RUN_STOPPED;
            break;
        }
        if (self->writes)
            stamp(self);
        int use = fd;
        if (fd < 0 && (use = open(self->path, self->flags | O_CLOEXEC)) < 0) {
            status = RUN_OPEN_FAILED;
            error = errno;
            break;
        }
        struct timespec start, end;
        long long steps[MAX_STEPS] = {0};
        clock_gettime(CLOCK_MONOTONIC, &start);
        *marker = ns(&start);
        moved = self->request(use, self->buffer.buf, size, at[i], steps);
        clock_gettime(CLOCK_MONOTONIC, &end);
        *marker = 0;
        if (moved < 0)
            error = errno;
        if (fd < 0)
            close(use);
        if (moved < 0 || (size_t)moved != size) {
            status = moved < 0 ? RUN_IO_FAILED : RUN_SHORT;
            break;
        }
        int zero = !self->writes && all_zero(self->buffer.buf, self->buffer.len);
        pthread_mutex_lock(&self->mutex);
        self->latency_ns[i] = ns(&end) - ns(&start);
        self->end_ns[i] = ns(&end);
        self->zero[i] = (unsigned char)zero;
        for (int k = 0; k < self->nsteps; k++)
            self->step_ns[k] += steps[k];
        self->produced = i + 1;
        pthread_mutex_unlock(&self->mutex);
        __atomic_add_fetch(&self->completed, 1, __ATOMIC_RELAXED);
        if (zero)
            __atomic_add_fetch(&self->zero_reads, 1, __ATOMIC_RELAXED);
        advance(self, now_ns());
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&offsets);
    return Py_BuildValue("(niin)", i, status, error, (Py_ssize_t)(moved < 0 ? 0 : moved));
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
    {"max_batch", (getter)Loop_max_batch, NULL, "the most offsets worth giving one run(): no limit", NULL},
    {"steps", (getter)Loop_steps, NULL, "nanoseconds in each step of the successful requests take() returned", NULL},
    {NULL},
};

static PyMethodDef Loop_methods[] = {
    {"run", (PyCFunction)Loop_run, METH_VARARGS, "run(offsets, fd) -> (done, status, errno, bytes)"},
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_timedio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__timedio(void) {
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
    for (int k = RUN_DONE; k <= RUN_SHORT; k++) {
        static const char *names[] = {"RUN_DONE", "RUN_STOPPED", "RUN_OPEN_FAILED", "RUN_IO_FAILED", "RUN_SHORT"};
        if (PyModule_AddIntConstant(m, names[k], k) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}

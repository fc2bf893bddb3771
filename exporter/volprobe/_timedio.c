/*
 * One direct I/O request timed in C: CLOCK_MONOTONIC read immediately before and after the pread/pwrite
 * and around nothing else, with the GIL released outside both clock reads. This keeps the interpreter (its
 * argument handling, the GIL hand-off, a cold code path after an idle interval) out of the measurement,
 * as fio's C loop does. volprobe falls back to timing in Python when this module could not be built.
 *
 * read(fd, buffer, offset, deadline_ns, inflight[, path, flags]) / write(...) -> (bytes, start_ns, end_ns)
 *   Sleeps until deadline_ns (CLOCK_MONOTONIC, absolute; 0 for now), then does the request. Waking and
 *   issuing in one call without the GIL is what fio's loop does: nothing else runs between the two.
 *   With fd -1, `path` is opened with `flags` after the sleep and closed after the request, so that the
 *   device is not held open between probes (an idle volprobe never stops a device from being detached).
 *   inflight is a writable 8-byte buffer (array('q')) that holds start_ns while the request is in flight,
 *   0 otherwise, for scrapes to read. Raises OSError on failure; an open failure carries the path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>

static long long ns(const struct timespec *t) { return (long long)t->tv_sec * 1000000000LL + t->tv_nsec; }

static PyObject *timed(PyObject *args, int write) {
    int fd, flags = 0;
    Py_buffer buffer, inflight;
    long long offset, deadline;
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, write ? "iy*LLw*|zi" : "iw*LLw*|zi", &fd, &buffer, &offset, &deadline, &inflight,
                          &path, &flags))
        return NULL;
    if (fd < 0 && path == NULL) {
        PyBuffer_Release(&buffer);
        PyBuffer_Release(&inflight);
        PyErr_SetString(PyExc_ValueError, "fd -1 needs a path to open");
        return NULL;
    }
    if (inflight.len < (Py_ssize_t)sizeof(long long)) {
        PyBuffer_Release(&buffer);
        PyBuffer_Release(&inflight);
        PyErr_SetString(PyExc_ValueError, "inflight must hold 8 bytes");
        return NULL;
    }
    volatile long long *marker = (volatile long long *)inflight.buf;
    struct timespec start, end, wake = {deadline / 1000000000LL, deadline % 1000000000LL};
    ssize_t done = -1;
    int error = 0, opened = -1;
    Py_BEGIN_ALLOW_THREADS
    if (deadline > 0)
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &wake, NULL) == EINTR)
            ;
    if (fd < 0) {
        opened = fd = open(path, flags | O_CLOEXEC);
        if (fd < 0)
            error = errno;
    }
    if (fd >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &start);
        *marker = ns(&start);
        done = write ? pwrite(fd, buffer.buf, (size_t)buffer.len, offset) : pread(fd, buffer.buf, (size_t)buffer.len, offset);
        clock_gettime(CLOCK_MONOTONIC, &end);
        *marker = 0;
        if (done < 0)
            error = errno;
    }
    if (opened >= 0)
        close(opened);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buffer);
    PyBuffer_Release(&inflight);
    if (fd < 0) {
        errno = error;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    }
    if (done < 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(nLL)", (Py_ssize_t)done, ns(&start), ns(&end));
}

static PyObject *timed_read(PyObject *self, PyObject *args) { return timed(args, 0); }
static PyObject *timed_write(PyObject *self, PyObject *args) { return timed(args, 1); }

static PyMethodDef methods[] = {
    {"read", timed_read, METH_VARARGS, "read(fd, buffer, offset, deadline_ns, inflight) -> (bytes, start_ns, end_ns)"},
    {"write", timed_write, METH_VARARGS, "write(fd, buffer, offset, deadline_ns, inflight) -> (bytes, start_ns, end_ns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_timedio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__timedio(void) { return PyModule_Create(&module); }

/*
 * LD_PRELOAD shim for the tests: ioprio_set fails with EPERM, as under the systemd unit's seccomp filter
 * without its ioprio_set exception. psutil (and glibc's callers) reach it through syscall(2).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>

long syscall(long number, ...) {
    static long (*real)(long, ...) = 0;
    if (!real)
        real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    va_list ap;
    va_start(ap, number);
    long a = va_arg(ap, long), b = va_arg(ap, long), c = va_arg(ap, long);
    long d = va_arg(ap, long), e = va_arg(ap, long), f = va_arg(ap, long);
    va_end(ap);
    if (number == SYS_ioprio_set) {
        errno = EPERM;
        return -1;
    }
    return real(number, a, b, c, d, e, f);
}

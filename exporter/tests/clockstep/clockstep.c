/*
 * LD_PRELOAD shim: steps CLOCK_REALTIME of one process, as NTP steps the system clock, and nothing else.
 *
 * The offset (whole seconds, signed) is read from the file named by $CLOCKSTEP_FILE at every wall-clock read,
 * so a test can step the clock back and forward under a running process. CLOCK_MONOTONIC and every other
 * clock, and all sleeps, pass through untouched: libfaketime shifts absolute monotonic sleeps too, which NTP
 * never does.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static long offset_seconds(void)
{
    const char *path = getenv("CLOCKSTEP_FILE");
    long offset = 0;
    if (path) {
        FILE *f = fopen(path, "r");
        if (f) {
            if (fscanf(f, "%ld", &offset) != 1)
                offset = 0;
            fclose(f);
        }
    }
    return offset;
}

int clock_gettime(clockid_t clock_id, struct timespec *tp)
{
    static int (*real)(clockid_t, struct timespec *);
    if (!real)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int result = real(clock_id, tp);
    if (result == 0 && (clock_id == CLOCK_REALTIME || clock_id == CLOCK_REALTIME_COARSE))
        tp->tv_sec += offset_seconds();
    return result;
}

int gettimeofday(struct timeval *tv, void *tz)
{
    struct timespec now;
    int result = clock_gettime(CLOCK_REALTIME, &now);
    if (result == 0 && tv) {
        tv->tv_sec = now.tv_sec;
        tv->tv_usec = now.tv_nsec / 1000;
    }
    (void)tz;
    return result;
}

time_t time(time_t *out)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    if (out)
        *out = now.tv_sec;
    return now.tv_sec;
}

/* The clock a condition variable's timed wait runs on.
 *
 * pthread_cond_timedwait takes an absolute deadline on the condition
 * variable's clock, CLOCK_REALTIME unless set otherwise.  A wall-clock step
 * (NTP, an administrator, a VM resumed) between computing the deadline and
 * waiting then stretches the wait by the size of the step: a 50 ms wait slice
 * becomes an hour, and with it a timeout or a Ctrl-C.  CLOCK_MONOTONIC never
 * steps.  Platforms without pthread_condattr_setclock (macOS) keep the wall
 * clock; MXL_COND_CLOCK_NAME says which one was compiled in.
 */
#ifndef MXL_COND_H
#define MXL_COND_H

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#if defined(CLOCK_MONOTONIC) && defined(_POSIX_CLOCK_SELECTION) && \
    _POSIX_CLOCK_SELECTION >= 0 && !defined(__APPLE__)
#define MXL_COND_CLOCK CLOCK_MONOTONIC
#define MXL_COND_CLOCK_NAME "CLOCK_MONOTONIC"
#define MXL_COND_SETCLOCK 1
#else
#define MXL_COND_CLOCK CLOCK_REALTIME
#define MXL_COND_CLOCK_NAME "CLOCK_REALTIME"
#define MXL_COND_SETCLOCK 0
#endif

/* pthread_cond_init on MXL_COND_CLOCK; 0 or an errno value. */
static int mxl_cond_init(pthread_cond_t *cond)
{
#if MXL_COND_SETCLOCK
    pthread_condattr_t attr;
    int rc = pthread_condattr_init(&attr);
    if (rc != 0)
        return rc;
    rc = pthread_condattr_setclock(&attr, MXL_COND_CLOCK);
    if (rc == 0)
        rc = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return rc;
#else
    return pthread_cond_init(cond, NULL);
#endif
}

/* The absolute deadline `seconds` (>= 0) from now, on MXL_COND_CLOCK. */
static void mxl_cond_deadline(struct timespec *ts, double seconds)
{
    long whole = (long)seconds;
    long nsec;
    clock_gettime(MXL_COND_CLOCK, ts);
    nsec = ts->tv_nsec + (long)((seconds - (double)whole) * 1e9);
    ts->tv_sec += whole + nsec / 1000000000L;
    ts->tv_nsec = nsec % 1000000000L;
}

#endif

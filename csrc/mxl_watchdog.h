/* A worker's parent watchdog: a native thread that SIGKILLs its process as
 * soon as a socket whose other end only the main process holds hangs up (the
 * main process died, or closed it at shutdown).
 *
 * Native on purpose: it needs no GIL.  A Python thread would have to take the
 * GIL back to act, so a worker whose main thread holds it (a C extension busy
 * for seconds, a starved machine) outlived its parent for as long. */
#ifndef MXL_WATCHDOG_H
#define MXL_WATCHDOG_H

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

static void *mxl_watchdog_main(void *arg)
{
    struct pollfd p;
    p.fd = (int)(intptr_t)arg;
    p.events = 0;   /* POLLHUP and POLLERR are always reported; no data is consumed */
    for (;;) {
        p.revents = 0;
        if (poll(&p, 1, -1) < 0) {
            if (errno == EINTR)
                continue;
            return NULL;
        }
        if (p.revents & (POLLHUP | POLLERR | POLLNVAL))
            kill(getpid(), SIGKILL);
    }
}

/* Start watching `fd` (a private duplicate: the process may close its own
 * copy); once per process.  0, or an errno value. */
static int mxl_start_watchdog(int fd)
{
    static pid_t started_in = 0;   /* a forked child inherits the flag, not the thread */
    pthread_t thread;
    pthread_attr_t attr;
    sigset_t all, previous;
    int watched, rc;

    if (started_in == getpid())
        return 0;
    watched = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    if (watched < 0)
        return errno;
    if ((rc = pthread_attr_init(&attr)) != 0) {
        close(watched);
        return rc;
    }
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    /* Signals stay with Python's threads: the watchdog starts with all blocked. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    rc = pthread_create(&thread, &attr, mxl_watchdog_main, (void *)(intptr_t)watched);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        close(watched);
        return rc;
    }
    started_in = getpid();
    return 0;
}

#endif /* MXL_WATCHDOG_H */

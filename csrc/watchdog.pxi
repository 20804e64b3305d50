# The worker side of "workers die with the main process" for workers whose
# parent is not the main process's only thread (spawn, forkserver): see
# mxl_watchdog.h for why it is a native thread.


def watch_main_process(int fd):
    """SIGKILL this process when `fd`'s peer hangs up; its peer must be held by
    the main process alone.  Once per process; later calls do nothing."""
    cdef int rc = mxl_start_watchdog(fd)
    if rc != 0:
        raise OSError(rc, f"could not start the parent watchdog: {os.strerror(rc)}")

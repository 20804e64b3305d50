# Signals around critical sections (the shutdown sequence, the engine's
# start-up, a frame handled in Python) and inside finalizers.
#
# NOTE [ Deferred signals ]
#
# Python runs a signal's handler between any two bytecodes of the main
# thread, and a handler may raise: Ctrl-C's KeyboardInterrupt, a program's
# SIGTERM handler (checkpoint and exit) or SIGALRM handler (a step timeout).
# Landing inside the shutdown sequence the exception would leave workers
# running and descriptors open; landing inside a finalizer (`__del__`, a
# buffer's release callback) Python prints it as "Exception ignored" (or the
# finalizer swallows it) and the program carries on: the signal is lost.
#
# `defer_sigint(fn)` runs fn with the handler of every signal that has a
# Python handler replaced by a recorder, and delivers each signal that
# arrived meanwhile once fn is done: at once (a plain call runs the handler
# as the call ends, as the signal would have), or, for a finalizer, by making
# the signal pending again, so that the handler runs at the next bytecode of
# the code the finalizer interrupted.  These wrappers are compiled on
# purpose: no bytecode runs between their call and the deferral, and a signal
# already pending when they swap handlers (signal.signal runs pending
# handlers first) is caught here and delivered like the others.

# The C module, not `signal`: its getsignal/signal are Python wrappers, and a
# Ctrl-C landing in their bytecode, before the deferral is active, would escape it.
import _signal
from types import MethodType as _MethodType

# Every signal that can have a Python handler (SIGKILL and SIGSTOP cannot).
cdef list _CATCHABLE = sorted(int(s) for s in _signal.valid_signals()
                              if s not in (_signal.SIGKILL, _signal.SIGSTOP))

# Main thread only (signal handlers run there, and only there can they be
# swapped).  A deferral is active exactly while _deferring is set: nested
# calls see it and leave the signals to the outermost one.
cdef bint _deferring = False
# The signals that arrived while a deferral was active, in order.
cdef list _arrived = []


def _record_signal(signum, frame):
    """The handler of every signal with a Python handler while a deferral is active."""
    if signum not in _arrived:
        _arrived.append(signum)


cdef inline void _rearm(int signum) noexcept:
    # Pending again: Python runs the handler at the main thread's next check
    # (ignored if the signal has no Python handler by then).
    PyErr_SetInterruptEx(signum)


cdef object _call_deferring_signals(object fn, tuple args, dict kwargs, bint finalizer):
    """Run fn with every signal that has a Python handler (SIGINT's
    KeyboardInterrupt, a program's SIGTERM or SIGALRM handler) held back,
    then deliver each one that arrived meanwhile, once."""
    global _deferring
    if _deferring:
        return fn(*args, **kwargs)   # an outer deferral collects the signals
    cdef list swapped = []           # (signum, its handler), to restore
    cdef object early = None         # an exception a handler raised while we swapped
    cdef int signum
    try:
        for signum in _CATCHABLE:
            previous = _signal.getsignal(signum)
            if not callable(previous) or previous is _record_signal:
                continue   # SIG_IGN, SIG_DFL or a C handler: Python raises nothing for it
            while True:
                try:
                    # signal.signal runs the handlers of signals pending
                    # meanwhile first (those swapped already only record).
                    _signal.signal(signum, _record_signal)
                    swapped.append((signum, previous))
                    break
                except ValueError:
                    if not swapped:
                        return fn(*args, **kwargs)   # not the main thread: no handler runs here
                    raise
                except BaseException as e:
                    # A handler of a signal not yet swapped ran just now and
                    # raised: delivered once fn is done, as if deferred.
                    if early is None:
                        early = e
    except BaseException:
        _restore(swapped)
        raise
    if not swapped:
        if early is not None:
            _deliver(early, finalizer)   # fn has not run: the signal landed before the call
        return fn(*args, **kwargs)
    _deferring = True
    _arrived.clear()
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        late = _end_deferral(swapped)
        for raised in (early, late):
            if raised is not None:
                _deliver(raised, finalizer)
        if not finalizer:
            PyErr_CheckSignals()   # a handler's exception wins, chained to fn's error
        raise
    late = _end_deferral(swapped)
    try:
        for raised in (early, late):
            if raised is not None:
                _deliver(raised, finalizer)
        if not finalizer:
            PyErr_CheckSignals()   # runs the handlers here, as the signals would have
    except BaseException:
        result = None          # released first: its own finalizer ends what it holds
        raise
    # A handler that does not raise (a program's "stop after this step"
    # flag) has run: the call's result stands.
    return result


cdef int _deliver(object raised, bint finalizer) except -1:
    """Raise what a handler raised before or after the deferral proper (it
    has run: it cannot be made pending again).  A finalizer cannot raise: a
    KeyboardInterrupt is made pending again instead (SIGINT's handler raises
    it once more, in the code the finalizer interrupted); another exception
    is raised, and Python reports it as from any `__del__`."""
    if finalizer and isinstance(raised, KeyboardInterrupt):
        _rearm(SIGINT)
        return 0
    raise raised


cdef object _restore(list swapped):
    """Put every swapped handler back; the first exception a restored
    handler raised meanwhile (a signal arriving as they are put back), or None."""
    cdef object raised = None
    for signum, previous in swapped:
        while True:
            try:
                _signal.signal(signum, previous)
                break
            except BaseException as e:   # a handler already back ran first and raised
                if raised is None:
                    raised = e
    return raised


cdef object _end_deferral(list swapped):
    """End the deferral: the signals that arrived meanwhile are made pending
    again, for their own handlers to run at the next check; returns what
    _restore returns."""
    global _deferring
    try:
        PyErr_CheckSignals()   # pending ones reach the recorder, while it is still the handler
    except BaseException:
        pass                   # (it never raises)
    raised = _restore(swapped)
    _deferring = False
    for signum in _arrived:
        _rearm(signum)
    _arrived.clear()
    return raised


@cython.final
cdef class _SigintDeferred:
    """A function (or method) wrapped by defer_sigint or sigint_safe_finalizer."""
    cdef readonly object __wrapped__
    cdef bint _finalizer

    def __init__(self, fn, bint finalizer):
        if not callable(fn):
            raise TypeError(f"expected a callable, got {type(fn).__name__}")
        self.__wrapped__ = fn
        self._finalizer = finalizer

    def __get__(self, obj, objtype):
        return self if obj is None else _MethodType(self, obj)

    def __call__(self, *args, **kwargs):
        return _call_deferring_signals(self.__wrapped__, args, kwargs, self._finalizer)

    def __repr__(self):
        kind = "sigint_safe_finalizer" if self._finalizer else "defer_sigint"
        return f"<{kind} of {self.__wrapped__!r}>"


def defer_sigint(fn):
    """Decorator: in the main thread, a signal with a Python handler (Ctrl-C,
    a program's SIGTERM or SIGALRM handler) that arrives while `fn` runs is
    held back until `fn` has returned or raised, then delivered once: the
    handler runs as the call ends (Python's SIGINT handler raises
    KeyboardInterrupt from the call; a handler that does not raise leaves
    the call's result as it was).
    Nested calls defer to the outermost one; other threads run `fn` as is."""
    return _SigintDeferred(fn, False)


def sigint_safe_finalizer(fn):
    """Decorator for `__del__`: like defer_sigint, but a signal that arrived
    while `fn` ran is made pending again instead of handled, so the code the
    finalizer interrupted gets the handler's exception (Python would ignore
    one raised inside a finalizer).  Other exceptions are reported by Python as
    ignored, as from any `__del__`."""
    return _SigintDeferred(fn, True)

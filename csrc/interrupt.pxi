# Ctrl-C around critical sections (the shutdown sequence, the engine's
# start-up) and inside finalizers.
#
# Python raises KeyboardInterrupt between any two bytecodes of the main
# thread.  Landing inside the shutdown sequence it would leave workers running
# and descriptors open; landing inside a finalizer (`__del__`, a buffer's
# release callback) Python prints it as "Exception ignored" (or the finalizer
# swallows it) and the program carries on: the user's Ctrl-C is lost.
#
# `defer_sigint(fn)` runs fn with the SIGINT handler replaced by a recorder
# and delivers a Ctrl-C that arrived meanwhile once fn is done: at once (a
# plain call raises KeyboardInterrupt as the handler would), or, for a
# finalizer, by making the signal pending again, so that the handler runs at
# the next bytecode of the code the finalizer interrupted.  These wrappers are
# compiled on purpose: no bytecode runs between their call and the deferral,
# and a SIGINT already pending when they swap handlers (signal.signal runs
# pending handlers first) is caught here and deferred like the others.

# The C module, not `signal`: its getsignal/signal are Python wrappers, and a
# Ctrl-C landing in their bytecode, before the deferral is active, would escape it.
import _signal
from types import MethodType as _MethodType

# Main thread only (signal handlers run there, and only there can they be
# swapped).  A deferral is active exactly while the recorder is the handler:
# nested calls see it and leave the signal to the outermost one.
cdef bint _sigint_arrived = False


def _record_sigint(signum, frame):
    """The SIGINT handler while a deferral is active."""
    global _sigint_arrived
    _sigint_arrived = True


cdef inline void _rearm_sigint() noexcept:
    # Pending again: Python runs the handler at the main thread's next check.
    PyErr_SetInterruptEx(SIGINT)


cdef object _call_deferring_sigint(object fn, tuple args, dict kwargs, bint finalizer):
    global _sigint_arrived
    previous = _signal.getsignal(_signal.SIGINT)
    if previous is _record_sigint:
        return fn(*args, **kwargs)   # an outer deferral collects the signal
    if not callable(previous):
        return fn(*args, **kwargs)   # SIG_IGN, SIG_DFL or a C handler: Python raises nothing
    cdef bint interrupted = False
    while True:
        try:
            _signal.signal(_signal.SIGINT, _record_sigint)
            break
        except KeyboardInterrupt:
            interrupted = True       # arrived just before the swap: deferred as well
        except ValueError:
            return fn(*args, **kwargs)   # not the main thread: no KeyboardInterrupt here
    _sigint_arrived = False
    try:
        result = fn(*args, **kwargs)
    except BaseException:
        if _end_deferral(previous, interrupted):
            _rearm_sigint()
            if not finalizer:
                PyErr_CheckSignals()   # the KeyboardInterrupt wins, chained to fn's error
        raise
    if _end_deferral(previous, interrupted):
        _rearm_sigint()
        if not finalizer:
            try:
                PyErr_CheckSignals()   # runs the handler here, as the signal would have
            except BaseException:
                result = None          # released first: its own finalizer ends what it holds
                raise
            # A handler that does not raise (a program's "stop after this
            # step" flag) has run: the call's result stands.
    return result


cdef bint _end_deferral(object previous, bint interrupted) except -1:
    """Restore the handler; whether a SIGINT was held back."""
    global _sigint_arrived
    # Restoring runs the recorder first for a signal still pending.
    _signal.signal(_signal.SIGINT, previous)
    interrupted = interrupted or _sigint_arrived
    _sigint_arrived = False
    return interrupted


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
        return _call_deferring_sigint(self.__wrapped__, args, kwargs, self._finalizer)

    def __repr__(self):
        kind = "sigint_safe_finalizer" if self._finalizer else "defer_sigint"
        return f"<{kind} of {self.__wrapped__!r}>"


def defer_sigint(fn):
    """Decorator: in the main thread, a Ctrl-C (SIGINT with a Python handler)
    that arrives while `fn` runs is held back until `fn` has returned or
    raised, then delivered once: the handler runs as the call ends (Python's
    default handler raises KeyboardInterrupt from the call; a handler that
    does not raise leaves the call's result as it was).
    Nested calls defer to the outermost one; other threads run `fn` as is."""
    return _SigintDeferred(fn, False)


def sigint_safe_finalizer(fn):
    """Decorator for `__del__`: like defer_sigint, but a Ctrl-C that arrived
    while `fn` ran is made pending again instead of raised, so the code the
    finalizer interrupted gets the KeyboardInterrupt (Python would ignore one
    raised inside a finalizer).  Other exceptions are reported by Python as
    ignored, as from any `__del__`."""
    return _SigintDeferred(fn, True)

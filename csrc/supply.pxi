# An epoch's batches of indices, drawn from the batch sampler as they are needed (torch draws
# its sampler the same way): the first batch goes out as soon as its indices exist, an infinite
# sampler works, and memory does not grow with the sampler's length.  The training loop's
# thread draws: the in-process producer (mxload/_runtime/epoch.py) once per batch, the engine's
# window (window.pxi) as it fills the prefetch window.

@cython.final
@cython.auto_pickle(False)
cdef class BatchSupply:
    """The epoch's batch iterator, `batches` ((batch index, indices) pairs in order, the
    batches a resumed epoch had taken left out), one batch drawn ahead, so the epoch's end is
    known when its last batch is handed out (a checkpoint taken then is the next epoch's).

    peek() is the first batch not handed out, or None at the end; its taker hands it out by
    setting `handed` past its index: a plain store, so a signal handler's exception cannot
    land between the hand-over and the record of it (peek() drops what is behind `handed`;
    NOTE [ Signal-safe hand-over ], handoff.pxi).

    A draw that raises (the sampler's own error, or a signal handler's exception that landed
    in the sampler's code, which leaves a generator finished; not one that landed in mxload's
    check of a batch, see CheckedBatches) ends the supply: the batches
    drawn before it are handed out, then peek() raises it (with a note naming the sampler,
    the batch and the epoch) once, and EpochAbortedError after.  An Exception raised while
    drawing ahead waits for its turn; anything else (KeyboardInterrupt) is raised at once."""

    cdef public object batches      # iterator of (batch index, indices)
    cdef public object skip         # batch indices a resumed epoch had taken (a set), or None
    cdef public Py_ssize_t handed   # batches below this index were handed out
    cdef public object total        # the epoch's batches, once known (int), else None
    cdef public object expected     # what the batch sampler's len() said (int), or None
    cdef public object what         # the sampler, in words ("the sampler Foo")
    cdef public object epoch
    cdef public object error        # what ended the draws, or None
    cdef public bint error_raised   # `error` reached the loop once
    cdef object _head, _ahead       # drawn, not handed out; _END after the last
    cdef Py_ssize_t _drawn          # the batch index the next draw gets
    cdef Py_ssize_t _start          # the first batch index drawn (a resumed epoch's)
    cdef object _aborted
    cdef object _by_signal

    def __cinit__(self, batches, Py_ssize_t start, skip, total, expected, what, epoch, aborted,
                  by_signal=None):
        """`start`: the index of the first batch `batches` yields (a resumed epoch skips those
        below); `skip`: taken indices above it; `total`: the epoch's batches where known now;
        `aborted`: errors.EpochAbortedError; `by_signal(error)`: whether a signal handler
        raised `error` (where `batches` can draw again after it: CheckedBatches)."""
        self.batches = batches
        self.skip = skip if skip else None
        self.handed = start
        self._drawn = start
        self._start = start
        self.total = total
        self.expected = expected if expected is not None else total
        self.what = what
        self.epoch = epoch
        self._aborted = aborted
        self._by_signal = by_signal

    cdef object _draw(self):
        """The next batch not taken before: (index, indices), or _END (the epoch's count of
        batches then known); raises what ended the draws."""
        cdef Py_ssize_t idx
        while True:
            if self.error is not None:
                raise self._failure()
            idx = self._drawn
            try:
                indices = next(self.batches)
            except StopIteration:
                self.total = idx
                return _END
            except BaseException as e:
                if (self._by_signal is not None and getattr(self.batches, "retryable", False)
                        and self._by_signal(e)):
                    raise   # cut short mxload's check of a batch it holds: the next draw checks it
                self.error = e
                if isinstance(e, Exception):
                    e.add_note(f"mxload: raised by {self.what} while drawing batch {idx} of epoch "
                               f"{self.epoch}: the epoch ended, and its workers unless persistent; the "
                               f"batches before it were delivered")
                raise self._failure()
            self._drawn = idx + 1
            if self.skip is None or idx not in self.skip:
                return (idx, indices)

    cdef object _failure(self):
        """The error that ended the draws: itself the first time, then EpochAbortedError."""
        error = self.error
        if not self.error_raised:
            self.error_raised = True
            return error
        return self._aborted(f"the epoch cannot go on: {self.what} raised {type(error).__name__}"
                             f"({error}) while its batches were drawn (batch {self._drawn}); start a "
                             f"new epoch with iter(loader)")

    cpdef object peek(self):
        """The first batch not handed out, (index, indices), drawing as needed; None at the end."""
        while True:
            if self._head is None:
                if self._ahead is not None:
                    self._head, self._ahead = self._ahead, None
                else:
                    self._head = self._draw()
            if self._head is _END:
                return None
            if (<tuple>self._head)[0] >= self.handed:
                break
            self._head = None   # handed out already
        if self._ahead is None and self.error is None:
            try:
                self._ahead = self._draw()
            except Exception:
                self.error_raised = False   # kept in `error`: raised in its turn, after this batch
        return self._head

    @property
    def at_end(self):
        """Every batch was handed out."""
        return self._head is _END or (self._head is None and self._ahead is _END)

    @property
    def length(self):
        """The batches this epoch delivers (a resumed one: those not taken before); None if unknown."""
        n = self.total if self.total is not None else self.expected
        return None if n is None else max(0, n - self._skipped())

    @property
    def left(self):
        """The batches not yet handed out, as far as known; None if unknown."""
        n = self.total if self.total is not None else self.expected
        return None if n is None else max(0, n - self.handed)

    cdef Py_ssize_t _skipped(self):
        return self._start + (len(self.skip) if self.skip is not None else 0)


_END = object()   # BatchSupply: no batch after this one


@cython.final
@cython.auto_pickle(False)
cdef class DrawnBatches:
    """A sampler's indices in batches of `size` 1-D int64 arrays, drawn as they are iterated
    (mxload.sampler.BatchSampler over a sampler it does not draw whole: a user's, torch's, an
    infinite one), after the rollover `carry`; the incomplete last batch as `last` says
    ("keep", "discard", or "rollover": left in `rest` for the next epoch).  Compiled: the only
    Python code a draw runs is the sampler's own, so a signal handler's exception raised in
    mxload's code never lands in it."""

    cdef object _ints
    cdef Py_ssize_t _size
    cdef object _carry
    cdef object _last
    cdef bint _done
    cdef public object rest

    def __cinit__(self, indices, Py_ssize_t size, carry, last):
        self._ints = map(_operator_index, indices)   # floats refused, not truncated
        self._size = size
        self._carry = carry
        self._last = last

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        carry = self._carry
        drawn = np.fromiter(_islice(self._ints, self._size - len(carry)), dtype=np.int64)
        batch = np.concatenate((carry, drawn)) if len(carry) else drawn
        self._carry = batch[:0]
        if len(batch) == self._size:
            return batch
        self._done = True
        if self._last == "rollover":
            self.rest = batch
        elif self._last == "keep" and len(batch):
            return batch
        raise StopIteration


@cython.final
@cython.auto_pickle(False)
cdef class CheckedBatches:
    """The batches of `raw` (a batch sampler's, or a sampler's keys), each made what the loader
    sends by `check(batch, position)` (mxload's Python).  The raw batch is held until checked:
    an exception raised in `check` (a signal handler's, which may land in any Python code)
    loses nothing, and the next call checks it again; `retryable` says the last exception was
    such (BatchSupply then keeps drawing)."""

    cdef object _raw
    cdef object _check
    cdef object _held
    cdef Py_ssize_t _position
    cdef public bint retryable

    def __cinit__(self, raw, check, Py_ssize_t position):
        self._raw = raw
        self._check = check
        self._position = position

    def __iter__(self):
        return self

    def __next__(self):
        if self._held is None:
            self.retryable = False
            self._held = (next(self._raw),)
        self.retryable = True
        out = self._check((<tuple>self._held)[0], self._position)
        self._held = None
        self._position += 1
        self.retryable = False
        return out

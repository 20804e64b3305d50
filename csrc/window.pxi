# The engine's consumer side, compiled: the prefetch window and the hand-over of each batch,
# which the training loop's thread runs once per batch (mxload/_runtime/engine.py owns one
# EngineWindow; the Python engine keeps everything that happens once per epoch or on failure).

cdef extern from *:
    """
    /* Forks of this process so far, as the child counts them (pthread_atfork): a batch is
     * taken only in the process that made the engine, and comparing this costs nothing per
     * batch where getpid() is a system call (glibc caches no pid). */
    static long mxl_fork_generation = 0;
    static void mxl_count_fork(void) { mxl_fork_generation++; }
    """
    long mxl_fork_generation
    void mxl_count_fork() noexcept nogil

if pthread_atfork(NULL, NULL, mxl_count_fork) != 0:
    raise OSError("pthread_atfork failed: mxload could not count forks")

# An engine's states (EngineWindow.state, which Engine.state is): the window dispatches while
# RUNNING; shutdown.shutdown_sequence runs once, in SHUTTING_DOWN.  Python reads them from here.
cdef str _RUNNING = "running"
RUNNING = _RUNNING
SHUTTING_DOWN = "shutting down"
CLOSED = "closed"


@cython.final
@cython.auto_pickle(False)
cdef class EngineWindow:
    """One engine's prefetch window and hand-over, compiled: next_batch (the
    consumer's call per batch: wait, claim, commit, refill) and
    dispatch_more (the window's refill), one call each instead of a chain
    of Python frames.  The engine (engine.py) sets every field; what happens
    once per epoch, or on a failure, it does in Python, called from here.

    The hand-over (NOTE [ Signal-safe hand-over ], handoff.pxi): the batch
    taken goes from the buffer's `handover` slot to the epoch's Handover's
    `ready` by plain stores.  A signal handler's exception is raised only by
    a call into Python code; here those are the transport's (next_result,
    claim, send_queued, flush: each retry-safe or whole), the roster's pick
    when its takers changed, and a transport without put_task's dispatch
    (which marks the epoch torn).  What such an exception interrupts leaves
    the batch in its slot, and the next call goes on from there."""

    cdef readonly object lock         # the engine's RLock: dispatch, results, the roster
    cdef readonly WorkerBooks roster  # the engine's Roster
    cdef readonly ReorderBuffer buffer
    cdef readonly dict counts         # the engine's counters ("batches")
    cdef public object transport
    # The transport's optional capabilities (transport.Capabilities, bound once its transport
    # started; None: not this transport's): put_task, receive, claim_raw and claim_mismatch.
    cdef public object put_task
    cdef public object receive
    cdef public object claim_raw
    cdef public object claim_mismatch
    cdef public Py_ssize_t prefetch        # tasks in flight at most
    cdef public Py_ssize_t in_flight       # dispatched and not yet taken
    cdef public Py_ssize_t next_dispatch   # tasks dispatched this epoch
    cdef public Py_ssize_t yielded         # the epoch's batches taken (or skipped)
    cdef public Py_ssize_t discard         # stream batches still to drop (a resumed stream)
    cdef public object state               # RUNNING, SHUTTING_DOWN, CLOSED (below)
    cdef public object epoch               # the epoch being served
    cdef public BatchSupply supply         # the epoch's batches of indices, drawn as needed; None: a stream
    cdef public object stream_indices      # a stream's tasks' "indices": None, or the epoch's key (a DataPipe's seed)
    cdef public object due                 # a deque: the batch indices dispatched, not yet taken, in order
    cdef public bint in_order
    cdef public bint profiling             # a profiler times the epoch's tasks
    cdef public object timeout             # the loader's, for a batch's wait
    # The epoch's Handover (begin_epoch's), whose `ready` the commit stores into; what the engine
    # raised last; what a signal handler's exception cut short.
    cdef public Handover handover
    cdef public object own_error
    cdef public object torn
    cdef long _forks
    # The wait for the batch at position `waited` (-1: none yet this epoch) began at
    # `_wait_start`: a call an exception cut short goes on with the same deadline.
    cdef public Py_ssize_t waited
    cdef int64_t _wait_start
    cdef object _end, _closed_by_other, _exhausted, _failure_type, _protocol_error
    # The engine's ways out, bound at construction: each error is recorded as the engine's own
    # (own_error) by the engine before it is returned here to raise.
    cdef object _forked_error       # () -> the error of a forked child's next()
    cdef object _aborted_error      # () -> the error of an epoch `torn` before
    cdef object _timed_out          # (idx) -> the error of a wait past the loader's timeout
    cdef object _claim_failed       # (idx, ProtocolError) -> the error of a batch not taken
    cdef object _failure            # () -> the engine's failure, or None (the buffer closed)
    cdef object _dispatch_unqueued  # (wid, idx, indices): a transport without put_task's dispatch

    def __cinit__(self, lock, WorkerBooks roster not None, ReorderBuffer buffer not None,
                  dict counts not None, tuple markers not None, *, forked_error, aborted_error,
                  timed_out, claim_failed, failure, dispatch_unqueued):
        """`markers`: (END, CLOSED_BY_OTHER, EXHAUSTED, BatchFailure, wire.ProtocolError);
        the keywords: the engine's ways out (above)."""
        self.lock = lock
        self.roster = roster
        self.buffer = buffer
        self.counts = counts
        self._end, self._closed_by_other, self._exhausted, self._failure_type, self._protocol_error = markers
        self._forked_error = forked_error
        self._aborted_error = aborted_error
        self._timed_out = timed_out
        self._claim_failed = claim_failed
        self._failure = failure
        self._dispatch_unqueued = dispatch_unqueued
        self.state = _RUNNING
        self.prefetch = 1
        self.in_order = True
        self.waited = -1
        self._forks = mxl_fork_generation
        self.due = deque()

    @property
    def forked(self):
        """Whether this is a forked child's copy (the workers are the parent's)."""
        return mxl_fork_generation != self._forks

    def next_batch(self, Py_ssize_t generation=-1):
        """(batch index, batch or BatchFailure), END, or CLOSED_BY_OTHER;
        raises what ended the epoch (recorded in `own_error`).  The batch is
        also left in the epoch's Handover's `ready` until handed to the loop.
        `generation`: the buffer's epoch count when the caller's epoch began
        (begin_epoch's answer; -1: the count now): once that epoch is over
        (another thread's iter() began the next on persistent workers, or
        the caller's iterator was closed meanwhile) this call neither takes
        the next epoch's batches nor waits for them: CLOSED_BY_OTHER."""
        cdef ReorderBuffer rb = self.buffer
        cdef Handover handover = self.handover
        cdef RawBatch raw
        cdef bint skip
        if handover is None:
            raise RuntimeError("next_batch before begin_epoch gave the window its epoch's Handover")
        if mxl_fork_generation != self._forks:
            raise self._forked_error()
        if generation < 0:
            generation = rb.epochs
        elif rb.epochs != generation:
            return self._closed_by_other
        if self.torn is not None:
            raise self._aborted_error()
        while True:
            taken = rb.handover   # a batch an exception kept from the last call
            if taken is None:
                if self.in_flight < self.prefetch:
                    # The dispatch after the last commit was cut short: with nothing in
                    # flight, the wait below would wait for a batch no worker was asked for.
                    self.dispatch_more()
                if rb.epochs != generation:
                    return self._closed_by_other
                taken = self._wait_for_next(generation)
                if type(taken) is not tuple:
                    return taken   # END, CLOSED_BY_OTHER
            idx, item = <tuple>taken
            with self.lock:
                if rb.epochs != generation:
                    # Over since the wait took this batch: the next begin_epoch takes it back
                    # from the hand-over slot (its slab to the pool) with the epoch's others.
                    return self._closed_by_other
                if type(item) is RawBatch:
                    raw = <RawBatch>item
                    key = (raw.epoch, raw.idx)
                    outstanding = self._outstanding(raw.slot)
                    try:
                        item = self._claim(raw, outstanding, key)   # again if a call before was cut short
                    except self._protocol_error as e:
                        raise self._claim_failed(idx, e) from None
                    if item is None:
                        if raw.epoch != self.epoch:
                            outstanding.pop(key, None)   # of an abandoned epoch
                        rb.handover = None
                        continue   # its worker died meanwhile: the task was dispatched again
                    del outstanding[key]
                skip = item is self._exhausted or self.discard > 0
                # The commit: no call into Python until the batch has moved from the
                # buffer's slot to `ready` (the deque's are C calls; NOTE [ Signal-safe hand-over ]).
                if self.supply is not None:
                    if self.in_order:
                        self.due.popleft()
                    else:
                        self.due.remove(idx)
                self.yielded += 1
                self.in_flight -= 1
                if skip:
                    if item is not self._exhausted:
                        self.discard -= 1   # replayed stream batch, already seen before the checkpoint
                else:
                    got = (idx, item)
                    handover = self.handover   # the epoch's (begin_epoch sets it under the lock)
                    handover.ready = got
                    if type(item) is not self._failure_type:
                        self.counts["batches"] += 1
                rb.handover = None
                self.dispatch_more()
            if not skip:
                return got

    cdef object _wait_for_next(self, Py_ssize_t generation):
        """Wait for the next batch (in order: the next of the plan; else any)
        and return what the wait left in the buffer's hand-over slot; END or
        CLOSED_BY_OTHER (also once the buffer begins an epoch after its
        `generation`-th).  Nothing is committed here."""
        cdef Py_ssize_t idx = -1
        cdef bint filling
        cdef BatchSupply supply = self.supply
        if supply is not None:
            if len(self.due) == 0:   # only the consumer takes from `due`
                if supply.at_end:
                    return self._end
                if supply.error is not None:   # the sampler's: in its turn, after the batches before
                    raise self._own(supply._failure())
        else:
            with self.lock:   # a stream: every worker's ended, and no task is out
                if self.in_flight == 0 and self.roster.all_done():
                    return self._end
        filling = self.yielded < self.prefetch   # the epoch's first window: a wait is the workers' start
        # The loader's timeout bounds the wait for one batch however many calls it takes: a
        # signal handler raising inside next() more often than that must not make it endless.
        cdef int64_t now = mxl_monotonic_ns()
        if self.waited != self.yielded:
            self.waited = self.yielded
            self._wait_start = now
        timeout = self.timeout
        if timeout is not None:
            timeout = max(0.0, timeout - (now - self._wait_start) / 1e9)
        cdef bint any_index = not self.in_order
        if not any_index:
            if supply is None:
                idx = self.yielded
            elif len(self.due) > 0:
                idx = self.due[0]
            else:   # none could be dispatched (no worker takes tasks): the next one's
                idx = supply.handed
        transport = self.transport
        receive = self.receive   # the transport's compiled wait, or None
        try:
            if type(receive) is ConsumerWait:   # (a C call)
                (<ConsumerWait>receive).wait(0 if any_index else idx, any_index, timeout, filling, generation)
            elif receive is not None:
                receive(0 if any_index else idx, any_index, timeout, filling, epochs=generation)
            else:
                transport.next_result(self.buffer, 0 if any_index else idx, any_index, timeout, filling,
                                      generation)
        except EpochOverError:
            return self._closed_by_other
        except TimeoutError:
            raise self._timed_out(idx) from None
        except BufferClosedError:
            failure = self._failure()
            if failure is not None:
                raise self._own(failure) from None
            return self._closed_by_other
        taken = self.buffer.handover
        if taken is None:
            raise AssertionError("a wait that returned left its batch in the hand-over slot")
        return taken

    cpdef object claim(self, RawBatch raw):
        """The batch the receive path stored raw, with its task's slab taken
        (the same batch for a RawBatch claimed before); None if the task is
        gone or of an abandoned epoch (engine lock held).  The caller removes
        the task from its worker's `outstanding`."""
        return self._claim(raw, self._outstanding(raw.slot),
                           (raw.epoch, raw.idx))

    cdef dict _outstanding(self, Py_ssize_t wid):
        """Worker `wid`'s tasks out (its record's `outstanding`)."""
        cdef list workers = self.roster.workers
        if workers is None or not 0 <= wid < len(workers):   # (this module indexes lists unchecked)
            raise IndexError(f"mxload's roster has no worker {wid}")
        return (<WorkerRecord?>workers[wid]).outstanding

    cdef object _own(self, error):
        """`error`, recorded as one that ends the epoch (next_batch raises it)."""
        self.own_error = error
        return error

    cdef object _claim(self, RawBatch raw, dict outstanding, key):
        """claim(), given the task's worker's `outstanding` and its `key` there."""
        transport = self.transport
        claim_raw = self.claim_raw   # the transport's compiled claim, or None
        if type(claim_raw) is RawClaim:   # (a C call)
            batch = (<RawClaim>claim_raw).claim(raw)
            if type(batch) is ClaimMismatch:
                raise self.claim_mismatch(raw, batch)
        elif claim_raw is not None:
            batch = claim_raw(raw)
            if type(batch) is ClaimMismatch:
                raise self.claim_mismatch(raw, batch)
        else:
            batch = transport.claim(raw)
        if batch is None:
            return None
        if key not in outstanding or raw.epoch != self.epoch:
            return None   # dropping the batch returns its slab to the pool
        return batch

    def dispatch_more(self):
        """Fill the window with the plan's next tasks (the engine lock taken
        here).  The task enters the books by stores no exception cuts short,
        and its worker's queue by put_task, last: an exception finds it in
        both or in neither, never sent twice nor lost.  What was put is sent
        now or by a later send_queued/flush."""
        cdef BatchSupply supply
        cdef list live
        cdef Py_ssize_t n, idx
        transport = self.transport
        put = self.put_task
        with self.lock:
            # The supply is read under the lock: a call that waited for it while another thread's
            # iter() began a new epoch (begin_epoch, which holds it) fills the window from the
            # new epoch's, never from the one this call began with.
            supply = self.supply
            while self.in_flight < self.prefetch and self.state == _RUNNING:
                n = self.next_dispatch
                if supply is not None:
                    # Drawn from the sampler now.  Its own error waits in the supply for its turn,
                    # after the batches dispatched before it; a signal handler's exception that
                    # left the supply able to draw again is raised (the next call dispatches).
                    try:
                        got = supply.peek()
                    except Exception as e:
                        if e is not supply.error:
                            raise
                        supply.error_raised = False   # the consumer raises it in its turn
                        got = None
                    if got is None:
                        transport.flush()   # the epoch's last tasks: none waits for another
                        return
                    idx, indices = <tuple>got
                else:
                    idx, indices = n, self.stream_indices
                # Round-robin by batch index: the roster's pick, from its cached takers
                # while they stand; anything else (a stream's cycle) is the roster's to decide.
                live = self.roster.takers
                if supply is not None and live is not None and len(live) > 0 \
                        and (self.in_order or len(live) == 1):
                    wid = live[idx % len(live)]
                else:
                    wid = self.roster.pick(idx, self.in_order, supply is None)
                    if wid is None:
                        return
                if put is None:
                    # (Ray) no such queue: its dispatch marks the epoch torn meanwhile, from before
                    # the batch leaves the supply.
                    self.torn = f"the dispatch of batch {idx}'s task"
                if supply is not None:
                    supply.handed = idx + 1
                    self.due.append(idx)
                if put is None:
                    self._dispatch_unqueued(wid, idx, indices)
                    continue
                epoch = self.epoch
                self._outstanding(wid)[(epoch, idx)] = indices
                self.next_dispatch = n + 1
                self.in_flight += 1
                if put(wid, (epoch, idx, indices, self.profiling)):
                    transport.send_queued(wid)

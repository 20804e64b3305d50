"""The loader's runtime: how a batch travels from the sampler to the consumer,
one module per stage.  Its only input is the loader's LoaderOptions
(``mxload/_options.py``); only ``messages.py`` and ``local/wire.py`` (and ``mxload/_collate``'s
layout) define a format that crosses processes.

    epoch.py       start_epoch and the one EpochIterator, for 0 workers (InProcessBatches)
                   or N (the engine)
    plan.py        EpochPlan: which batches (resumed or not: the batch sampler drawn as
                   batches are needed, _core.BatchSupply, csrc/supply.pxi)
    engine.py      Engine: epochs, failure record, restart policy; its prefetch window,
                   dispatch (round-robin by batch index) and consumption from the
                   ReorderBuffer run per batch, compiled (csrc/window.pxi: EngineWindow)
    results.py     Supervisor: the engine's ResultSink (each task's result into the
                   ReorderBuffer, a lost worker restarted or the epoch failed)
    roster.py      the engine's record of its workers: alive, exhausted, tasks held
    engine_errors.py  what ended an epoch, in words naming worker, pid and batch
    autotune/      num_workers="auto": model.py (the time per batch with k workers),
                   policy.py (AutoTuner: the choice at an epoch's start; Climb: the verdicts
                   on the engine's windows), producer.py (AutoBatches: measures, applies)
    transport.py   the seam: Transport (how tasks reach workers, results come back,
                   shutdown phases) and ResultSink (the engine, as a transport sees it)
    shutdown.py    the numbered shutdown sequence and its one deadline
    os_signals.py  signals and /proc for every kind of worker (neutral: imports no mxload)
    os_threads.py  mxload's threads as the kernel sees them (a fork after them warns not)
    os_malloc.py   glibc's malloc thresholds fixed where batches are loaded (page faults)
    transports.py  the one module naming the transports: the transport a backend
                   (mxload/backends.py, configuration) asks for; a new kind of worker is
                   one module and its backend class
    progress.py    EpochProgress: which batches of an epoch the loop has taken (what a
                   checkpoint records)
    local/         the process transport (local processes)
      transport.py   ProcessTransport: sockets, pooled slabs, the receive path
      pairing.py     how many of a worker's tasks go in one message (the policy)
      launcher.py    start method, starting/restarting/ending processes
      receiver.py    the receive path (run by the consumer) and the watcher thread:
                     adopt slabs, views, notice deaths
      zygote.py      the zygote (fork), spawn and forkserver workers, SIGINT at starts
      process_worker.py  a worker process's side of the task loop: its entry point, its
                     socket, collating into slabs
      wire.py        the messages' frames on a socket: send/recv of one frame, the packed
                     Task and BatchRef layouts (sizes checked against the core's)
      slabs.py       memfd slabs and the main process's pool
      heap.py        a worker process keeps the memory it frees (malloc thresholds), and
                     keeps what it inherited by fork out of its garbage collector (gc.freeze)
      fds.py         descriptors no forked child may keep
      inherit.py     a spawn or forkserver worker's payload, pickled once for all workers
    threads.py     ThreadTransport: a task queue per worker thread
    ray/           backend="ray": RayTransport (transport.py) and the LoaderActor
                   (actor.py), workers anywhere in a Ray cluster; Ray's error texts as
                   mxload quotes them (errors.py: no colour codes, an actor's creation error)
    worker.py      the one task loop of process and thread workers and Ray actors (it
                   imports no transport); WorkerInfo, seeding
    source.py      the samples of a batch (map-style indices or a stream)
    remote_errors.py  a worker's exception rebuilt in the training process (never raises)
    batch_errors.py   a batch's error as the loop gets it, in every mode (StopIteration,
                   SystemExit & co made errors of that batch)
    messages.py    Task, Stop, Batch, NewSlab, Loaded, Failed, Exhausted, InitFailed,
                   zygote and spawn messages (the types); WorkerConfig, what a worker
                   starts with

One batch with worker processes:

    DataLoader.__iter__ -> epoch.start_epoch: the batch sampler's iterator -> EpochPlan
      -> Engine.begin_epoch -> _core.EngineWindow.dispatch_more (compiled, as all of the
         consumer's per-batch path): the next batch's indices drawn from the BatchSupply
         as the window has room -> the transport's put_task: TaskHold holds it for a pair
         (local/pairing.py), _core.send_tasks packs and sends (a pooled slab with each) over
         the worker's socket
    worker process: worker.serve -> source.SampleSource.samples -> plan + fill the slab
      -> Batch (or NewSlab with its descriptor, Failed, Exhausted) -> local/wire.send
    training loop: EpochIterator.__next__ -> _core.EngineWindow.next_batch -> transport.next_result:
      the batch is in the ReorderBuffer, or the consumer receives it itself
      (receiver.Fetcher.next_result -> _core.FrameReceiver.get, GIL released: reads the workers'
      sockets, a BatchRef (layout named before) goes into the ReorderBuffer as a C struct;
      any other frame: wire.decode -> receiver.take_result (adopt the slab; numpy views
      owned by a BatchOwner) -> Loaded -> Engine.deliver -> ReorderBuffer.put)
      -> a raw one becomes views through the transport's claim (_core.claim_batch)
      -> (batch index, batch), and dispatch_more refills the window
      -> the epoch's _core.Handover: the compiled __next__ hands the batch out, counted taken
         at the next call (NOTE [ Signal-safe hand-over ], csrc/handoff.pxi)
    fetcher thread (FrameReceiver.watch): asleep on the workers' sentinels; when one
      ends it takes what that worker sent and reports the loss (restart) at once
"""

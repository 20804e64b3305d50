"""``num_workers="auto"``: the loader picks its worker count and window, and
keeps adjusting them while the epoch runs.

An epoch starts in the training loop's thread: its first batches (at least
PROBE_BATCHES and PROBE_MIN_S, at most PROBE_MAX_BATCHES) are loaded
in-process (they are the epoch's own first batches, not extra work) while the
tuner measures what one batch costs to load (fetch and collate: L), how long
the loop's step between two ``next()`` calls takes (S), how much of that step
is CPU time of the loop's own thread (S_cpu), and how many cores this process
may use (affinity and cgroup quota) less those other processes kept busy
meanwhile (/proc/stat): C.  A model
(`predict_ns`) gives the time per batch with k workers; the tuner takes the
fastest k, 0 included, asking a worker count to beat in-process loading by
WORKERS_MARGIN (the model does not see page faults or wake-ups); where only
the per-batch costs it estimates make workers lose, by at most CLOSE_CALL,
it measures them instead.  From the
second epoch on, the throughput the workers really reached (an epoch's best
window, or its whole engine phase where it ended before a window's verdict;
not the epoch that started persistent workers, which measured their start; the
upper median of the last ENGINE_RATES_KEPT epochs') is compared with
in-process's (the upper median of the last INPROCESS_RATES_KEPT measured:
probes, and the runs of epochs that stayed in-process after theirs): a machine
where workers lose gets 0 for the next 1, 2, 4 ... up to MAX_INPROCESS_EPOCHS
epochs; one where they win starts the next epoch on them, without a probe (once
in-process was measured RESUME_INPROCESS_RATES times, or for RESUMES_ON_ONE_RATE epochs
on fewer: a run's first probe is cold).
Where a probe found workers clearly slower (beyond CLOSE_CALL), the epochs of the
next REPROBE_S stay in-process without one and time their whole run instead; one
that runs SLOWED_PROBE below the kept in-process rate makes the next epoch probe.

With k >= 1 the rest of the epoch runs on the engine, whose `max_workers`
processes exist but only k take tasks; the window (``prefetch="auto"``)
starts at WINDOW_PER_WORKER tasks per worker taking tasks.  Every window of
WINDOW_BATCHES batches and WINDOW_MIN_S the tuner measures the loop's throughput and, every
few windows, tries a neighbour, in turn: one worker more, one
fewer, twice the tasks per worker, half.  A window that holds a switch (the
engine's start, a try's, an undone try's) mixes two settings' pipelines and
gets no verdict; a try is judged on the VERDICT_WINDOWS after its switch,
against the settled setting's last SETTLED_WINDOWS: kept if it was faster by
TRY_GAIN, else undone, and the next try waits twice as long (up
to MAX_TRY_EVERY windows; a kept change resets it).  That schedule is the
tuner's, not the epoch's: a setting whose tries did not pay is not tried again
at every epoch's start.  A try TRY_UNDO_LOSS slower than the settled rate in
a window that does not flatter it is undone at once (the switch's window
flatters a try toward less: a worker fewer, a smaller window).  Workers hand the epoch back to in-process
after LOSING_WINDOWS settled windows in a row below the probe's rate.  What
the climb settled on carries over
to the next epoch when the probe agrees that workers are worth it.  A
retired worker takes no new task; the tasks it holds are delivered as usual,
so no batch is lost, repeated or reordered, and which worker loads a batch
never changes what it holds (``sample_rng`` is keyed by seed, epoch and
sample, not by worker).

One module per job:

    model.py      predict_ns & co: the time per batch with k workers (pure functions)
    policy.py     AutoTuner (the choice at an epoch's start, kept across epochs) and Climb (the
                  verdicts on the engine's windows): decisions from measurements, no clock read
    producer.py   AutoBatches: the epoch's producer, which measures and applies them
"""
from .model import batch_nbytes, predict_ns
from .policy import AutoTuner, Choice, Climb
from .producer import AutoBatches

__all__ = ["AutoBatches", "AutoTuner", "Choice", "Climb", "batch_nbytes", "predict_ns"]

"""num_workers="auto" (mxload/_runtime/autotune/): what it picks, that its batches equal a
fixed worker count's bit for bit, and that adding and retiring workers mid-epoch loses,
repeats and reorders nothing."""
from __future__ import annotations

import itertools
import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from datasets_for_tests import EpochBatches, epoch_batches
from fresh_python import run

import mxload
from mxload._runtime import autotune
from mxload._runtime.autotune import policy, producer

pytestmark = pytest.mark.timeout(120)


class Augmented(mxload.Dataset):
    """Random augmentation from sample_rng(): the same for any worker count."""

    def __init__(self, n: int = 400):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = mxload.sample_rng()
        return np.float32(i) + rng.standard_normal(8).astype(np.float32), np.int64(i)


def flat(loader, limit=None):
    out = []
    for n, (x, y) in enumerate(loader):
        if limit is not None and n == limit:
            break
        out.append((x.tobytes(), y.tobytes()))
    return out


# num_workers="auto" tunes worker processes, or worker threads with thread_pool=True.
KINDS = [pytest.param({}, id="processes"), pytest.param({"thread_pool": True}, id="threads")]


@pytest.fixture
def three_cores(monkeypatch):
    """The tuner sees 3 usable cores (whatever this machine has), so it has room to move."""
    import mxload._cpus
    import mxload._iterations
    monkeypatch.setattr(mxload._cpus, "usable_cores", lambda: 3)
    monkeypatch.setattr(mxload._iterations, "usable_cores", lambda: 3)


@pytest.fixture
def workers_win(monkeypatch):
    """The model predicts the most workers fastest, and no epoch's measured rate overrules it:
    every epoch moves onto the engine."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 / (k + 1))
    monkeypatch.setattr(autotune.AutoTuner, "engine_rate", lambda self, rate: None)
    monkeypatch.setattr(autotune.AutoTuner, "losing_to_inprocess", lambda self, rate: False)


@pytest.fixture
def restless(monkeypatch):
    """Every window tries another worker count and keeps it: workers are added and retired
    every few batches."""
    monkeypatch.setattr(producer, "WINDOW_BATCHES", 3)
    monkeypatch.setattr(producer, "WINDOW_MIN_S", 0.0)
    monkeypatch.setattr(policy, "TRY_EVERY", 1)
    monkeypatch.setattr(policy, "TRY_GAIN", -1.0)
    monkeypatch.setattr(policy, "TRY_UNDO_LOSS", 1.0)   # never undone in the switch's window


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("persistent", [False, True])
def test_auto_batches_equal_a_fixed_worker_counts_bit_for_bit(three_cores, workers_win, persistent, kind):
    base = dict(batch_size=4, shuffle=True, seed=11)
    kw = dict(base, **kind)
    reference = [flat(mxload.DataLoader(Augmented(), **base, num_workers=0).__iter__()) for _ in range(1)]
    fixed = mxload.DataLoader(Augmented(), **kw, num_workers=2)
    with mxload.DataLoader(Augmented(), **kw, num_workers="auto", persistent_workers=persistent) as auto:
        epochs = [flat(auto) for _ in range(2)]
        assert auto.stats["auto_workers"] == 3 and auto.stats["batches"] > 0, auto.stats
        assert auto.autotune["max_workers"] == 3
    fixed_epochs = [flat(fixed) for _ in range(2)]
    assert epochs[0] == reference[0] == fixed_epochs[0]
    assert epochs[1] == fixed_epochs[1] and epochs[1] != epochs[0]   # a new shuffle, the same for both


@pytest.mark.parametrize("kind", KINDS)
def test_workers_added_and_retired_mid_epoch_lose_repeat_and_reorder_nothing(three_cores, workers_win,
                                                                             restless, kind):
    reference = flat(mxload.DataLoader(Augmented(1600), batch_size=2, seed=3))
    kw = dict(batch_size=2, seed=3, **kind)
    loader = mxload.DataLoader(Augmented(1600), **kw, num_workers="auto")
    assert flat(loader) == reference
    changes = loader.autotune["changes"]
    added = [c for c in changes if c[3] > c[2]]
    retired = [c for c in changes if c[3] < c[2]]
    assert len(added) >= 2 and len(retired) >= 2, changes   # up and down, more than once
    assert loader.stats["auto_changes"] == len(changes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_that_lose_to_in_process_hand_back_mid_epoch_and_the_next_epoch_stays_in_process(
        three_cores, monkeypatch, persistent, kind):
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 / (k + 1))
    monkeypatch.setattr(autotune.AutoTuner, "losing_to_inprocess", lambda self, rate: True)
    monkeypatch.setattr(producer, "WINDOW_BATCHES", 3)
    monkeypatch.setattr(producer, "WINDOW_MIN_S", 0.0)
    base = dict(batch_size=2, shuffle=True, seed=9)
    kw = dict(base, **kind)
    reference = [flat(r) for r in [mxload.DataLoader(Augmented(), **base)] * 2]
    with mxload.DataLoader(Augmented(), **kw, num_workers="auto", persistent_workers=persistent) as loader:
        it = iter(loader)
        first = flat(it)
        assert it.engine is not None and it._producer._current is it._producer._inprocess
        changes = loader.autotune["changes"]
        assert [c[3] for c in changes] == [0] and "back to in-process" in changes[0][4], changes
        if not persistent:   # its workers ended when it handed back, not at the epoch's end
            assert it.engine.state == "closed"
        second = flat(loader)
        assert loader.autotune["last_choice"]["workers"] == 0, loader.autotune
    assert [first, second] == reference


def test_a_try_is_judged_on_the_window_after_its_switch(three_cores, workers_win, restless):
    """The window in which a try switches settings flatters fewer workers (a retired worker still
    answers what it holds) and penalises more: no verdict on it.  Every window tries (TRY_EVERY
    1), so a kept try takes the settled window, the switch and VERDICT_WINDOWS more."""
    loader = mxload.DataLoader(Augmented(1600), batch_size=2, seed=3, num_workers="auto")
    flat(loader)
    taken = [c[1] for c in loader.autotune["changes"]]
    assert len(taken) >= 4, taken
    gaps = [b - a for a, b in zip(taken, taken[1:])]
    assert min(gaps) >= (2 + policy.VERDICT_WINDOWS) * producer.WINDOW_BATCHES, gaps


def test_in_order_false_with_auto_delivers_every_batch_once(three_cores, workers_win, restless):
    loader = mxload.DataLoader(Augmented(600), batch_size=2, seed=3, num_workers="auto", in_order=False)
    got = sorted(int(y[0]) for _, y in loader)
    assert got == list(range(0, 600, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_resume_mid_epoch_after_the_switch_to_workers(three_cores, workers_win, kind):
    whole = flat(mxload.DataLoader(Augmented(), batch_size=4, shuffle=True, seed=7))
    kw = dict(batch_size=4, shuffle=True, seed=7, **kind)
    loader = mxload.DataLoader(Augmented(), **kw, num_workers="auto")
    it = iter(loader)
    first = [(x.tobytes(), y.tobytes()) for x, y in itertools.islice(it, 40)]
    assert it.engine is not None, "past the probe, the epoch runs on workers"
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    resumed = mxload.DataLoader(Augmented(), **kw, num_workers="auto")
    resumed.load_state_dict(state)
    assert first + flat(resumed) == whole


@pytest.mark.parametrize("kind", KINDS)
def test_break_after_the_switch_ends_the_workers(three_cores, workers_win, kind):
    loader = mxload.DataLoader(Augmented(), batch_size=4, num_workers="auto", **kind)
    it = iter(loader)
    for n, _ in enumerate(it):
        if n == 30:
            break
    engine = it.engine
    assert engine is not None
    if kind:
        assert engine.worker_pids() == [None] * 3
        assert len([t for t in threading.enumerate() if t.name.startswith("mxload-worker-thread")]) == 3
    else:
        assert len([p for p in engine.worker_pids() if p is not None]) == 3
    del it, engine   # the conftest leak check proves the workers, threads, slabs and descriptors are gone


class FailsAt(Augmented):
    def __getitem__(self, i: int):
        if i == 150:
            raise KeyError(f"sample {i} is corrupt")
        return super().__getitem__(i)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dataset_error_after_the_switch_arrives_as_itself_and_the_epoch_goes_on(three_cores, workers_win,
                                                                                   kind):
    """An error raised by the dataset in a worker (process or thread) that auto started is the
    loop's, as itself and for its batch only (as torch: the loop may catch it and go on)."""
    loader = mxload.DataLoader(FailsAt(), batch_size=4, num_workers="auto", **kind)
    it = iter(loader)
    got, errors = [], []
    while True:
        try:
            x, y = next(it)
        except StopIteration:
            break
        except KeyError as e:
            errors.append(str(e))
            continue
        got.append(int(y[0]))
    assert it.engine is not None
    assert len(errors) == 1 and "sample 150 is corrupt" in errors[0], errors
    assert got == [i for i in range(0, 400, 4) if i != 148]
    del it


def test_a_short_epoch_stays_in_process():
    loader = mxload.DataLoader(Augmented(40), batch_size=4, num_workers="auto")
    it = iter(loader)
    assert [int(y[0]) for _, y in it] == list(range(0, 40, 4))
    assert it.engine is None and loader.stats["auto_workers"] == 0


def test_cheap_samples_and_a_cpu_bound_step_stay_in_process_on_one_core():
    # Real measurements, a model that must not pick workers where they cannot help.
    tuner = autotune.AutoTuner(max_workers=1, cores=1, auto_window=True, fixed_window=2)
    loads, steps = [200_000] * 8, [1_000_000] * 7
    assert tuner.choose(0, loads, steps, steps) == 0
    assert "in-process" in tuner.report()["last_choice"]["reason"]


def test_a_batch_cheap_to_gather_but_big_to_copy_stays_in_process(monkeypatch):
    """bench/autotune.py's tabular-getitems: 0.08 ms to gather 1 MB in-process, which a worker
    must also copy into shared memory: workers reached 0.4x of in-process there.  dict16 (0.85 ms
    for 1 MB) gains from 2 workers."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    tuner = autotune.AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4)
    mb = 1 << 20
    assert tuner.choose(0, [82_000] * 8, [7_000] * 7, [7_000] * 7, batch_bytes=mb) == 0
    assert tuner.report()["last_choice"]["batch_mb"] == 1.049
    assert tuner.choose(1, [850_000] * 8, [56_000] * 7, [56_000] * 7, batch_bytes=mb) == 2


def test_a_close_call_is_measured_and_the_measurement_decides(monkeypatch):
    """images on 2 cores: 0.58 ms to load 9.6 MB in-process; the model's estimates of a worker's
    own costs put 2 workers within a few percent of in-process, which only a measurement can
    settle.  Workers that then lose are not taken again at once."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    tuner = autotune.AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4)
    images = ([576_000] * 8, [12_000] * 7, [12_000] * 7)
    assert tuner.choose(0, *images, batch_bytes=9_633_792) == 2
    assert tuner.report()["last_choice"]["reason"].startswith("a close call, measured: 2 workers")
    tuner.engine_rate(1000.0)   # measured: in-process did 1700 batches/s
    assert tuner.choose(1, *images, batch_bytes=9_633_792) == 0
    assert "last epoch's workers reached 1000" in tuner.report()["last_choice"]["reason"]


# tabular-getitems' probe on 2 cores, warm: (loads, steps, step CPU) in ns; 1 MiB batches.
GETITEMS_PROBE = ([90_000] * 8, [7_000] * 7, [7_000] * 7)
MB = 1 << 20


def two_core_tuner(monkeypatch) -> autotune.AutoTuner:
    """A fresh tuner on a 2-core machine, up to 2 workers."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    return autotune.AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4)


def test_one_slow_probe_does_not_make_losing_workers_look_faster(monkeypatch):
    """tabular-getitems on 2 cores: one probe slowed by a hiccup (0.24 ms a batch, where
    in-process does 0.097) made it a close call, and its workers (8460 batches/s, 0.82x of
    in-process) were kept for the rest of the run because they beat that one probe."""
    tuner = two_core_tuner(monkeypatch)
    slowed = ([223_000] * 8, [17_000] * 7, [17_000] * 7)
    assert tuner.choose(0, *GETITEMS_PROBE, batch_bytes=MB) == 0
    # Alone, the slowed probe's figures make a close call ...
    alone = two_core_tuner(monkeypatch)
    assert alone.choose(0, *slowed, batch_bytes=MB) == 2 and "a close call" in alone.choices[-1].reason
    # ... after a probe 2.5x faster, they are a hiccup.
    assert tuner.choose(1, *slowed, batch_bytes=MB) == 0
    # Workers measured at 8460 would not be resumed for beating the slowed probe either.
    tuner.settled, tuner._engine_rate = (2, 2), 8460.0
    assert tuner.resume_workers() == 0


def test_heavy_samples_on_many_cores_get_workers_and_the_fewest_that_keep_up(monkeypatch):
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 8)
    tuner = autotune.AutoTuner(max_workers=8, cores=8, auto_window=True, fixed_window=16)
    # 4 ms to load a batch, a 1 ms step that sleeps (a GPU's): 4 workers keep up, more would idle.
    k = tuner.choose(0, [4_000_000] * 8, [1_000_000] * 7, [50_000] * 7)
    assert k == 4, tuner.report()
    assert tuner.window(k) == 8 and tuner.counts == {"auto_workers": 4, "auto_window": 8, "auto_changes": 0}
    # The same machine with 6 of its 8 cores kept busy by other programs: fewer workers pay.
    assert tuner.choose(1, [4_000_000] * 8, [1_000_000] * 7, [50_000] * 7, others_busy=6.0) < 4


def test_workers_slower_than_in_process_last_epoch_give_in_process_next_epoch():
    tuner = autotune.AutoTuner(max_workers=4, cores=4, auto_window=True, fixed_window=8)
    assert tuner.choose(0, [4_000_000] * 8, [0] * 7, [0] * 7) > 0
    tuner.engine_rate(150.0)   # what the workers really reached; in-process does 250 batches/s
    assert tuner.choose(1, [4_000_000] * 8, [0] * 7, [0] * 7) == 0
    assert "last epoch's workers reached 150" in tuner.report()["last_choice"]["reason"]


def test_an_epoch_too_short_for_a_window_still_measures_its_workers(monkeypatch, three_cores):
    """Fast batches in short epochs: no throughput window ends before the epoch does, and the
    epoch's engine rate is what tells the next epoch whether its workers paid."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 / (k + 1))
    monkeypatch.setattr(producer, "WINDOW_MIN_S", 1e3)
    loader = mxload.DataLoader(Augmented(200), batch_size=4, num_workers="auto", persistent_workers=True)
    try:
        assert len(flat(loader)) == 50
        tuner = loader._iterations.tuner
        assert tuner.counts["auto_workers"] == 3 and not tuner.changes
        # The epoch that started the persistent workers measured their start, not their pace.
        assert tuner._engine_rate is None
        assert len(flat(loader)) == 50
        assert tuner._engine_rate is not None and tuner._engine_rate > 0
        # Workers slower than in-process (forced here): the next epoch's probe keeps it in-process.
        tuner._engine_rate = 1.0
        assert len(flat(loader)) == 50
        assert tuner.choices[-1].workers == 0 and "workers reached 1 batches/s" in tuner.choices[-1].reason
    finally:
        loader.close()


def test_one_core_affinity_picks_zero_or_one_worker():
    result = run("""
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        class Spin(mxload.Dataset):
            def __len__(self): return 240
            def __getitem__(self, i):
                t = time.perf_counter()
                while time.perf_counter() - t < 0.0002: pass
                return np.float32(i)
        loader = mxload.DataLoader(Spin(), batch_size=4, num_workers="auto")
        n = 0
        for batch in loader:
            t = time.perf_counter()
            while time.perf_counter() - t < 0.0005: pass   # a CPU-bound training step
            n += 1
        print(n, loader.autotune["max_workers"], loader.autotune["workers"])
    """, timeout=60)
    assert result.returncode == 0, result.stderr
    n, most, chosen = map(int, result.stdout.split())
    assert n == 60 and most == 1 and chosen in (0, 1), result.stdout


@pytest.mark.parametrize("kw, words", [
    (dict(num_workers="fast"), "num_workers"),
    (dict(num_workers="auto", prefetch="deep"), "prefetch"),
    (dict(num_workers="auto", backend="ray"), "num_workers='auto' tunes local workers"),
])
def test_bad_auto_arguments_name_what_was_wrong(kw, words):
    with pytest.raises(ValueError, match=words):
        mxload.DataLoader(Augmented(), batch_size=4, **kw)


def test_auto_refuses_a_stream_with_the_reason():
    class Stream(mxload.IterableDataset):
        def __iter__(self):
            yield from range(10)
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        mxload.DataLoader(Stream(), batch_size=2, num_workers="auto")


def test_the_profiler_report_says_what_auto_chose_and_why(three_cores, workers_win):
    loader = mxload.DataLoader(Augmented(), batch_size=4, num_workers="auto", profile=True)
    assert len(flat(loader)) == 100
    report = loader.profiler.report()
    assert report.to_dict()["autotune"]["workers"] == 3
    assert "num_workers='auto': 3 workers, window 6 (of at most 3)" in str(report)
    assert "last choice: 3 workers predicted" in str(report)


@pytest.mark.parametrize("how", ["handed back mid-epoch", "measured at the epoch's end"])
def test_after_workers_lose_the_tuner_waits_longer_each_time_before_trying_them_again(how):
    tuner = autotune.AutoTuner(max_workers=4, cores=4, auto_window=True, fixed_window=8)
    heavy = ([4_000_000] * 8, [0] * 7, [0] * 7)
    picks = []
    for epoch in range(8):
        picks.append(tuner.choose(epoch, *heavy))
        if picks[-1]:   # the workers lost again, at 100 batches/s
            tuner.handed_back(100.0) if how == "handed back mid-epoch" else tuner.engine_rate(100.0)
    # Workers, then in-process for 1, 2 and 4 epochs between the tries (a loss measured at the
    # epoch's end is seen at the next epoch's start, which is the first of them).
    assert [bool(k) for k in picks] == [True, False, True, False, False, True, False, False]
    if how == "handed back mid-epoch":
        assert "in-process for this and 0 more epoch(s)" in tuner.choices[1].reason
        assert "(100 vs 250 batches/s)" in tuner.choices[1].reason
    else:
        assert "in-process for this and 1 more epoch(s)" in tuner.choices[3].reason


def two_cores(monkeypatch) -> autotune.AutoTuner:
    """A tuner on 2 cores that chose 2 workers for decode-bound batches (40 ms each: 25 a second
    in-process)."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    tuner = autotune.AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4)
    assert tuner.choose(0, [40_000_000] * 8, [0] * 7, [0] * 7) == 2
    return tuner


def auto_batches(tuner: autotune.AutoTuner) -> autotune.AutoBatches:
    """An epoch's AutoBatches of 400 batches, over a producer that is never called."""
    from mxload._runtime.plan import EpochPlan
    from mxload._runtime.progress import EpochProgress
    from mxload.sampler import EpochBatches
    plan = EpochPlan.of(lambda start: EpochBatches(iter([np.arange(1)] * 400), 400, 400, "the sampler"),
                        EpochProgress(0, None, None), 0)
    starts = SimpleNamespace(inprocess=lambda part: SimpleNamespace(ready=None), engine=None)
    return autotune.AutoBatches(tuner, 0, plan, starts, None, True)


def test_a_probe_too_short_for_proc_stat_takes_the_last_load_it_could_measure(monkeypatch):
    """A quarter of a short epoch of fast batches (2.4 ms for tabular-getitems) is shorter than
    /proc/stat's 10 ms tick: one tick read as 4 cores busy and cut the workers the model could
    use."""
    tuner = two_cores(monkeypatch)
    auto = auto_batches(tuner)
    tuner.others_busy = 0.5
    auto._probe_start = (time.perf_counter_ns(), 0.0, 0.0)   # nonsense counters: not read
    assert auto._others_busy() == 0.5
    from mxload._cpus import machine_busy_s, own_cpu_s
    if machine_busy_s() is None:
        pytest.skip("no /proc/stat")
    auto._probe_start = (time.perf_counter_ns() - int(producer.PROBE_MIN_S * 2e9), machine_busy_s(),
                         own_cpu_s())
    measured = auto._others_busy()
    assert measured == tuner.others_busy and 0.0 <= measured <= 64


def test_epochs_of_auto_do_not_read_the_cgroup_files_again(monkeypatch):
    """The oversubscription check reads the cgroup's quota (0.33 ms): "auto" takes at most the
    usable cores, so it is checked once, when the loader is built, not at every in-process
    epoch's iter()."""
    import mxload.dataloader
    calls = []
    monkeypatch.setattr(mxload.dataloader, "warn_if_oversubscribed", lambda *a: calls.append(a))
    loader = mxload.DataLoader(Augmented(40), batch_size=4, num_workers="auto")
    for _ in range(3):
        assert len(flat(loader)) == 10
    fixed = mxload.DataLoader(Augmented(40), batch_size=4, num_workers=0)
    flat(fixed)
    assert len(calls) == 1, calls


def test_epochs_that_stay_in_process_measure_their_whole_run(monkeypatch):
    """The probe's first batches flatter in-process (images: 1350-1700 batches/s where whole
    in-process runs made 1243): an epoch that stays in-process after its probe adds what its
    run reached to the rates workers are compared with."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 * (k + 1))   # in-process wins
    monkeypatch.setattr(policy, "REPROBE_S", 0.0)   # every epoch probes
    loader = mxload.DataLoader(Augmented(), batch_size=4, num_workers="auto")
    tuner = loader._iterations.tuner
    for _ in range(2):
        it = iter(loader)
        assert len(flat(it)) == 100 and it.engine is None
    assert [c.workers for c in tuner.choices] == [0, 0]
    assert len(tuner._inprocess_rates) == 4 and min(tuner._inprocess_rates) > 0   # 2 probes, 2 runs


def test_workers_faster_than_whole_in_process_runs_are_resumed_though_probes_flatter_in_process(monkeypatch):
    tuner = two_cores(monkeypatch)   # its probe: 25 batches/s in-process
    tuner.inprocess_measured(30.0)
    tuner.settled, tuner._engine_rate = (2, 2), 27.0
    assert tuner.resume_workers() == 0   # the probes' (upper median) rate: 30
    for _ in range(2):
        tuner.inprocess_measured(20.0)   # two whole in-process runs
    tuner._engine_rate = 27.0
    assert tuner.resume_workers() == 2


def test_workers_chosen_on_a_runs_first_probe_alone_are_not_resumed_without_another(monkeypatch):
    """tabular-getitems on 2 cores: a run's first probe, cold (0.24 ms a batch where in-process
    takes 0.09), sent the epoch to workers, which then beat that one probe every epoch and kept
    the whole run on them at 0.94x of in-process.  One in-process rate is not evidence enough:
    after RESUMES_ON_ONE_RATE epochs resumed on it, an epoch probes again, and its warm probe
    sends the workers back.  (Probing at once cost augment's and jpeg's two-epoch runs 5-10%.)"""
    tuner = two_core_tuner(monkeypatch)
    cold = ([600_000] * 8, [17_000] * 7, [17_000] * 7)
    assert tuner.choose(0, *cold, batch_bytes=MB) == 2
    tuner.settled = (2, 2)       # as the engine's start sets it
    tuner.engine_rate(9_000.0)   # the workers' epoch: far above the cold probe's ~1600
    for _ in range(policy.RESUMES_ON_ONE_RATE):
        assert tuner.resume_workers() == 2
        tuner.engine_rate(9_000.0)
    assert tuner.resume_workers() == 0, "resumed on one probe's word for good"
    assert tuner.choose(1, *GETITEMS_PROBE, batch_bytes=MB) == 0
    assert tuner.report()["last_choice"]["reason"].startswith("in-process is as fast")
    # With two in-process rates measured, workers that beat them are resumed without a probe.
    tuner._engine_rates.clear()
    tuner.settled, tuner._engine_rate = (2, 2), 20_000.0
    assert tuner.resume_workers() == 2


def test_one_slow_epoch_on_workers_does_not_send_them_back(monkeypatch):
    """An engine phase of 30 ms varies by 20%: tabular's workers (1.5x in-process) lost one epoch
    in three to in-process and went back to it.  The last 3 epochs' upper median decides."""
    tuner = two_cores(monkeypatch)   # in-process: 25 batches/s
    tuner.inprocess_measured(25.0)   # a second in-process rate: resuming needs two
    tuner.settled = (2, 2)
    for rate, workers in [(50.0, 2), (50.0, 2), (20.0, 2), (20.0, 0)]:
        tuner.engine_rate(rate)
        assert tuner.resume_workers() == workers, rate


def test_epochs_after_a_clear_in_process_win_skip_their_probe_until_one_is_due(monkeypatch):
    """tabular-getitems (0.09 ms batches, 97 an epoch): a probe and its choice in every epoch
    cost 4-7% of in-process's throughput.  Where the last probe found workers clearly slower,
    epochs skip theirs for REPROBE_S, still measuring their whole in-process run."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 * (k + 1))   # workers 2x slower
    monkeypatch.setattr(policy, "REPROBE_S", 3600.0)
    # However slow an epoch runs on a busy machine (the whole suite on 2 cores), not "slowed":
    # that rule, tested below, would make the next epoch probe.
    monkeypatch.setattr(policy, "SLOWED_PROBE", 1.0)
    loader = mxload.DataLoader(Augmented(), batch_size=4, num_workers="auto")
    tuner = loader._iterations.tuner
    for _ in range(4):
        it = iter(loader)
        assert len(flat(it)) == 100 and it.engine is None
    assert [c.workers for c in tuner.choices] == [0]
    assert tuner.report()["epochs_without_probe"] == 3
    # The probe's rate and all four runs' (the first after its probe, three whole).
    assert len(tuner._inprocess_rates) == 5 and min(tuner._inprocess_rates) > 0
    tuner._probe_due_ns = time.perf_counter_ns()   # REPROBE_S has passed
    assert len(flat(loader)) == 100
    assert [c.workers for c in tuner.choices] == [0, 0]


def test_a_close_call_or_a_backoff_never_skips_the_next_probe(monkeypatch):
    """Only a clear win of in-process skips probes: a close call, or in-process forced by
    workers that lost, leaves every next epoch its probe."""
    monkeypatch.setattr(policy, "REPROBE_S", 3600.0)
    tuner = two_core_tuner(monkeypatch)   # workers predicted 2x slower:
    assert tuner.choose(0, *GETITEMS_PROBE, batch_bytes=MB) == 0 and tuner.probe_skipped()
    tuner = two_core_tuner(monkeypatch)
    images = ([576_000] * 8, [12_000] * 7, [12_000] * 7)   # a close call, measured
    assert tuner.choose(0, *images, batch_bytes=9_633_792) == 2 and not tuner.probe_skipped()
    tuner.engine_rate(1000.0)   # lost to in-process's 1700
    assert tuner.choose(1, *images, batch_bytes=9_633_792) == 0 and not tuner.probe_skipped()


def test_an_unprobed_epoch_much_slower_than_in_process_was_makes_the_next_one_probe(monkeypatch):
    """The samples got dearer (or the machine busier) while probes were skipped: an epoch whose
    whole run falls SLOWED_PROBE below the kept in-process rate makes the next epoch probe."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 * (k + 1))
    monkeypatch.setattr(policy, "REPROBE_S", 3600.0)
    loader = mxload.DataLoader(Augmented(), batch_size=4, num_workers="auto")
    tuner = loader._iterations.tuner
    flat(loader)
    assert tuner.probe_skipped()
    tuner._inprocess_rates.extend([1e9] * 4)   # in-process was measured far faster than it is
    flat(loader)   # unprobed; its run is far below that
    assert not tuner.probe_skipped()
    flat(loader)
    assert [c.workers for c in tuner.choices] == [0, 0]


@pytest.mark.parametrize("windows", [False, True])
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_started_by_the_epoch_count_against_it_only_if_they_end_with_it(monkeypatch, three_cores,
                                                                                 persistent, windows):
    """images, dict16: the epoch that forked the persistent workers measured them cold (their
    start, first faults) below in-process, and the next epoch went back in-process for nothing.
    Workers that end with the epoch pay their start every epoch: that rate is the truth.  The
    same whether windows ended in the epoch or only its whole rate was measured."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 / (k + 1))
    monkeypatch.setattr(autotune.AutoTuner, "losing_to_inprocess", lambda self, rate: False)
    if windows:
        monkeypatch.setattr(producer, "WINDOW_BATCHES", 3)
        monkeypatch.setattr(producer, "WINDOW_MIN_S", 0.0)
        monkeypatch.setattr(policy, "TRY_EVERY", 10**6)   # no try: settled windows only
    else:
        monkeypatch.setattr(producer, "WINDOW_MIN_S", 1e3)   # no window ends: the epoch's whole rate
    loader = mxload.DataLoader(Augmented(200), batch_size=4, num_workers="auto",
                               persistent_workers=persistent)
    try:
        assert len(flat(loader)) == 50
        tuner = loader._iterations.tuner
        assert (tuner._engine_rate is None) == persistent
    finally:
        loader.close()


def _epoch(e: int, n: int) -> list[list[int]]:
    """Epoch e's batches from EpochBatches(..., spacing=200)."""
    return epoch_batches(200 * e, n)


@pytest.mark.slow   # a worker sleeps 1 s in one batch
def test_a_next_waiting_on_the_workers_ends_when_a_newer_iter_starts_its_epoch_in_process(three_cores,
                                                                                          workers_win):
    """Persistent workers under "auto": one thread waits in next() for epoch 0's batch 40,
    which its worker is slow to make (1 s); another thread's iter() begins an epoch too short to
    leave in-process, so no epoch begins on the workers.  The waiting next() raises
    "superseded" at once, and the new epoch is whole.  It used to wait for the slow batch."""
    from conftest import next_waiting_in_thread
    from datasets_for_tests import SlowDataset

    ds = SlowDataset(1.0, n=1000, only=frozenset({80}))
    with mxload.DataLoader(ds, batch_sampler=EpochBatches(64, 8, spacing=200), num_workers="auto",
                           persistent_workers=True, timeout=10) as loader:
        first = iter(loader)
        assert [next(first).ravel().tolist() for _ in range(40)] == _epoch(0, 40)
        assert first.engine is not None   # on the workers since its probe
        consumer, got = next_waiting_in_thread(first, False, "the consumer waiting for batch 40")
        second = iter(loader)
        consumer.join(0.5)
        assert not consumer.is_alive(), "the superseded next() went on waiting"
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "superseded" in str(got[0]), got
        assert [b.ravel().tolist() for b in second] == _epoch(1, 8)
        assert second.engine is None


def test_a_superseded_epoch_starts_no_workers_and_takes_over_none(three_cores, workers_win):
    """A thread's epoch chose workers (its probe done, the switch due at its next call), and it
    is descheduled while another thread's iter() supersedes it: its call then starts no engine
    and begins nothing on the loader's workers (CLOSED_BY_OTHER).  It used to start workers
    for an epoch already over, whose engine the newer epoch's then replaced and nothing ever
    shut down (a worker process and a thread left after loader.close(); the leak check)."""
    from mxload._runtime.results import CLOSED_BY_OTHER

    with mxload.DataLoader(mxload.ArrayDataset(np.arange(1000)), batch_sampler=EpochBatches(64, spacing=200),
                           num_workers="auto", persistent_workers=True, timeout=10) as loader:
        first = iter(loader)
        auto = first._producer   # what first's next() calls once past its check
        while not auto._switch_to:
            next(first)   # the probe, in-process
        second = iter(loader)
        assert auto.next_batch() is CLOSED_BY_OTHER
        assert auto.engine is None and loader._iterations.engine is None
        assert [b.tolist() for b in second] == _epoch(1, 64)


@pytest.mark.races
@pytest.mark.timeout(300)
def test_a_newer_iter_while_another_thread_s_epoch_starts_its_workers_leaves_nothing(seed):
    """Persistent workers under "auto", race_rounds(10) rounds: one thread's epoch is starting
    its workers (a process of ours has appeared) when another thread's iter() begins the next
    epoch.  The new epoch is whole; the old thread ends with its epoch or "superseded"; after
    loader.close() no worker or thread of the round is left (and the leak check at the end)."""
    import random
    import threading

    from conftest import descendant_pids, race_rounds, wait_until
    from datasets_for_tests import SlowDataset

    rng = random.Random(seed)
    for r in range(race_rounds(10)):
        before, threads = descendant_pids(), threading.active_count()
        loader = mxload.DataLoader(SlowDataset(0.0003, n=1000), batch_sampler=EpochBatches(64, spacing=200),
                                   num_workers="auto", persistent_workers=True, timeout=20)
        old, ended = iter(loader), []

        def consume(it=old, out=ended):
            try:
                for _ in it:
                    pass
                out.append("exhausted")
            except BaseException as e:
                out.append(e)

        def started(out=ended, known=before):
            return out or descendant_pids() - known

        consumer = threading.Thread(target=consume)
        consumer.start()
        wait_until(started, what="the old epoch's workers starting")
        time.sleep(rng.uniform(0, 0.002))
        new = iter(loader)
        assert [b.ravel().tolist() for b in new] == _epoch(1, 64), f"round {r}"
        consumer.join(10)
        assert not consumer.is_alive(), f"round {r}: the old thread is still in next()"
        assert ended[0] == "exhausted" or "superseded" in str(ended[0]), f"round {r}: {ended[0]!r}"
        loader.close()
        del loader, old, new

        def left(known=before, count=threads):
            return descendant_pids() - known, threading.active_count() - count

        wait_until(lambda: left() == (set(), 0),
                   what=f"round {r}: the workers and their threads gone after close()")


@pytest.mark.parametrize("num_workers", [0, "auto"])
def test_a_signal_handlers_exception_in_the_probe_keeps_its_batch_as_in_process_loading(num_workers):
    """auto's in-process phase has num_workers=0's semantics (docs/guarantees.md, "Signals"; the
    guide said the opposite): a signal handler's exception raised inside the dataset's code
    reaches the loop, and the next next() loads that batch again; the dataset's own exception
    uses its batch up."""
    import os
    import signal

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop("a step timeout")

    class SignalledAt(mxload.Dataset):
        def __init__(self):
            self.signalled = self.failed = False

        def __len__(self):
            return 64

        def __getitem__(self, i):
            if i == 9 and not self.signalled:
                self.signalled = True
                os.kill(os.getpid(), signal.SIGUSR1)   # its handler runs here, in the dataset's code
            if i == 21 and not self.failed:
                self.failed = True
                raise KeyError(i)
            return np.int64(i)

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        loader = mxload.DataLoader(SignalledAt(), batch_size=4, num_workers=num_workers)
        it = iter(loader)
        got = []
        for _ in range(8):   # the probe's batches (at least 4) and a few more: all in-process
            try:
                got.append(next(it).tolist())
            except Stop:
                got.append("signal")
            except KeyError:
                got.append("dataset")
        assert it.engine is None
        del it
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], "signal", [8, 9, 10, 11], [12, 13, 14, 15],
                   [16, 17, 18, 19], "dataset", [24, 25, 26, 27]], got


def test_reasons_count_one_worker_in_the_singular(monkeypatch):
    """loader.autotune's reasons said "1 workers predicted ..."."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    stays = autotune.AutoTuner(max_workers=1, cores=1, auto_window=True, fixed_window=2)
    assert stays.choose(0, [200_000] * 8, [1_000_000] * 7, [1_000_000] * 7) == 0
    goes = autotune.AutoTuner(max_workers=1, cores=2, auto_window=True, fixed_window=2)
    assert goes.choose(0, [20_000_000] * 8, [20_000_000] * 7, [1_000_000] * 7) == 1   # a GPU step
    for tuner, reason in ((stays, "in-process is as fast: 1 worker predicted"), (goes, "1 worker predicted")):
        said = tuner.report()["last_choice"]["reason"]
        assert said.startswith(reason) and "1 workers" not in said, said

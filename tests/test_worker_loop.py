"""The one task loop of process and thread workers (mxload/_runtime/worker.py; a process's
link: local/process_worker.py), driven through a fake link: what a worker answers to each task."""
import numpy as np
import pytest

from mxload._runtime import messages as m
from mxload._runtime.source import SampleSource
from mxload._runtime.worker import WorkerLink, serve


class FakeLink(WorkerLink):
    def __init__(self, tasks, broken_send=False):
        super().__init__()
        self.tasks = list(tasks)
        self.sent = []
        self.reseeded = []
        self.broken_send = broken_send

    def next_task(self):
        return self.tasks.pop(0) if self.tasks else None

    def reseed(self, epoch):
        self.reseeded.append(epoch)

    def collate(self, task, samples, batchify_fn, t0, t1):
        assert t0 <= t1
        return m.Loaded(task.epoch, task.batch_index, batchify_fn(samples), None)

    def send_batch(self, reply):
        self.sent.append(reply)

    def send(self, message):
        if self.broken_send:
            raise BrokenPipeError("the main process went away")
        self.sent.append(message)


class Squares:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 7:
            raise KeyError("sample 7 is missing")
        return i * i


def task(epoch, idx, indices):
    return m.Task(epoch, idx, np.array(indices, dtype=np.int64).tobytes())


def run(tasks, init=None, dataset=None, iterable=False, **link_kwargs):
    link = FakeLink(tasks, **link_kwargs)
    dataset = dataset if dataset is not None else Squares()
    serve(link, 0, (dataset, list, init), SampleSource(dataset, iterable, 2, False, seed=1), epoch=0)
    return link


def test_every_task_gets_one_result_in_order_and_a_new_epoch_reseeds():
    link = run([task(0, 0, [1, 2]), task(0, 1, [3]), task(1, 0, [4, 5]), task(1, 1, [0])])
    assert link.sent == [m.Loaded(0, 0, [1, 4], None), m.Loaded(0, 1, [9], None),
                         m.Loaded(1, 0, [16, 25], None), m.Loaded(1, 1, [0], None)]
    assert link.reseeded == [1]


def test_a_batch_error_is_that_batchs_failure_and_the_loop_goes_on():
    link = run([task(0, 0, [6, 7]), task(0, 1, [8])])
    failed, loaded = link.sent
    assert isinstance(failed, m.Failed) and (failed.epoch, failed.batch_index) == (0, 0)
    assert failed.error.qualname == "KeyError" and "sample 7 is missing" in failed.error.message
    assert loaded == m.Loaded(0, 1, [64], None)


def test_a_failed_worker_init_fn_is_reported_and_no_task_runs():
    def init(worker_id):
        raise RuntimeError(f"init failed in worker {worker_id}")
    link = run([task(0, 0, [1])], init=init)
    (failed,) = link.sent
    assert isinstance(failed, m.InitFailed) and failed.error.message == "init failed in worker 0"
    assert len(link.tasks) == 1


def test_the_end_of_a_stream_is_exhausted_for_every_later_task():
    link = run([m.Task(0, i, None) for i in range(3)], dataset=[10, 11, 12], iterable=True)
    assert link.sent == [m.Loaded(0, 0, [10, 11], None), m.Loaded(0, 1, [12], None), m.Exhausted(0, 2)]


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt("k"), GeneratorExit("g"),
                                    StopIteration("s")])
def test_every_exception_out_of_the_dataset_is_that_batchs_failure_and_the_loop_goes_on(raised):
    """In every kind of worker (process, thread, Ray actor): a SystemExit & co or a StopIteration
    too (the training process makes them an error it can take: batch_errors.py).  Before, a
    worker thread ended at a SystemExit, and the epoch with it."""
    class Raising(Squares):
        def __getitem__(self, i):
            if i == 1:
                raise raised
            return super().__getitem__(i)
    try:
        link = run([task(0, 4, [1]), task(0, 5, [2])], dataset=Raising())
    except BaseException as e:   # noqa: BLE001 - a KeyboardInterrupt must fail this test, not end the run
        pytest.fail(f"the worker loop ended with {type(e).__name__}: {e}")
    failed, loaded = link.sent
    assert isinstance(failed, m.Failed) and failed.batch_index == 4
    assert failed.error.qualname == type(raised).__name__
    assert loaded == m.Loaded(0, 5, [4], None)


def test_a_loop_that_cannot_report_ends_saying_what_it_was_doing():
    link = FakeLink([task(0, 4, [7])], broken_send=True)
    with pytest.raises(BrokenPipeError):
        serve(link, 0, (Squares(), list, None), SampleSource(Squares(), False, 2, False, 1), epoch=0)
    assert link.doing == "loading batch 4"


def test_a_call_site_outside_the_main_guard_is_told_from_one_inside(tmp_path):
    from mxload._runtime.local.launcher import outside_main_guard
    script = tmp_path / "train.py"
    script.write_text("import mxload\n"               # 1
                      "loader = None\n"               # 2
                      "if __name__ == '__main__':\n"  # 3
                      "    run(loader)\n"             # 4
                      "if '__main__' == __name__:\n"  # 5
                      "    run(loader)\n"             # 6
                      "if __name__ != '__main__':\n"  # 7
                      "    run(loader)\n")            # 8
    site = str(script)
    assert [outside_main_guard((site, line)) for line in (2, 4, 6, 8)] == [True, False, False, True]
    assert not outside_main_guard((str(tmp_path / "missing.py"), 2))   # unreadable: no claim
    (tmp_path / "broken.py").write_text("def (:\n")
    assert not outside_main_guard((str(tmp_path / "broken.py"), 1))

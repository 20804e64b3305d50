"""A batch's error as the training loop gets it, the same with 0 workers, worker processes,
worker threads and Ray actors: an error for that batch, which uses the batch up and which
the loop may catch and go on (as torch), never one that the loop would take for something
else.

- A StopIteration out of the dataset or batchify_fn would end ``for batch in loader`` as if
  the epoch were over (the same iterator then went on with the next batches): it becomes a
  RuntimeError chained from it, as PEP 479 does for one escaping a generator.
- A BaseException that is no Exception (SystemExit, KeyboardInterrupt, GeneratorExit) would
  end the training program, or pass for a Ctrl-C: it becomes a WorkerError naming it and the
  batch, chained from it.  A Ctrl-C or a signal handler's exception that lands in the dataset's
  code while the training process loads a batch itself is not the batch's: InProcessBatches
  (epoch.py) raises those as they are, before they get here.
"""
from __future__ import annotations

from ..errors import WorkerError
from .messages import safe_text

__all__ = ["as_loop_error"]


def as_loop_error(error: BaseException, origin: str, worker_id: int | None, pid: int | None,
                  batch_index: int) -> BaseException:
    """`error`, raised by the dataset or batchify_fn where `origin` says ("Raised in worker 1
    (pid 7) while loading batch 3."; `batch_index` -1: by worker_init_fn, whose failure ends
    the epoch), as the loop gets it: itself, unless it is one of the two kinds above.  Never
    raises."""
    if isinstance(error, Exception) and not isinstance(error, StopIteration):
        return error
    name = type(error).__name__
    text = safe_text(error)
    said = f"{name}: {text}" if text else name
    raiser = "the dataset or batchify_fn" if batch_index >= 0 else "worker_init_fn"
    instead = ("this batch's error instead: the batch is used up and the next call goes on with the next one"
               if batch_index >= 0 else "reported as this error instead")
    wrapped: BaseException
    if isinstance(error, StopIteration):
        wrapped = RuntimeError(
            f"{raiser} raised {said}. {origin} A StopIteration there would end the training loop's `for` "
            f"as if the epoch were over (PEP 479 turns one escaping a generator into a RuntimeError for "
            f"the same reason), so it is {instead}")
    else:
        wrapped = WorkerError(
            f"{raiser} raised {said}. {origin} A {name} (a BaseException that is not an Exception) there "
            f"would end the training program or be taken for a Ctrl-C, so it is {instead}",
            worker_id, pid, None, batch_index if batch_index >= 0 else None)
    wrapped.__cause__ = error
    return wrapped

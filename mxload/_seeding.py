"""The run's seed, each iteration's base seed, and a torch IterDataPipe's shared seed.

The run's seed: given, drawn at the first ``iter()`` from torch's RNGs as
torch's DataLoader draws its base seed (the loader's generator, else the
global RNG, when the program imported torch), or fresh.  At every ``iter()``
what torch's ``iter()`` draws is drawn here too, in torch's order (an
IterDataPipe's shared seed, the iterator's base seed, the shared seed again
where workers start, then its RandomSampler's seed at the first batch), so
the program's later draws (its model's initialisation, dropout) are the ones
it gets with torch's loader.  The base seed drawn is the one the workers of
``seeding="torch"`` start from (``base_seed + worker id``, as torch's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._rng import derived_seed
from ._torch_compat import (
    datapipe_seed_group,
    datapipe_shards,
    draw_datapipe_seed,
    is_datapipe,
    is_iter_datapipe,
    seed_datapipe,
    seed_from_torch,
    shard_datapipe,
)
from .sampler import RandomSampler

if TYPE_CHECKING:
    from ._options import LoaderOptions


# Mixed into (seed, epoch) for an IterDataPipe's shared seed with seed= ("datapipe" in ASCII).
_DATAPIPE_SEED_KEY = 0x6461746170697065


class RunSeed:
    """When the run's seed and each iteration's base seed are drawn.  It reads what it is
    given and returns what it drew: the loader (dataloader.py, which imports this module) sets
    its own seed and options from that."""

    def __init__(self, torch_seeded: bool):
        self.pending = torch_seeded   # drawn at the first iter(), as torch's
        self._base_drawn = False
        # Under torch.distributed: the gloo group an IterDataPipe's shared seed is broadcast over
        # (made at the loader's first iter(); False: not made yet).
        self._datapipe_group: Any = False

    def _draw_datapipe_seed(self, generator: Any) -> int:
        if self._datapipe_group is False:
            self._datapipe_group = datapipe_seed_group()
        return draw_datapipe_seed(generator, self._datapipe_group)

    def draw(self, generator: Any) -> int:
        """The run's seed, drawn from torch (the loader's `generator`, or torch's global RNG):
        also the base seed of the first iteration's workers, and the seed of the loader's own
        RandomSampler (DataLoader._seeded sets them)."""
        seed = seed_from_torch(generator)
        self._base_drawn = True
        return seed

    def datapipe_epoch_starts(self, options: LoaderOptions, epoch: int, in_process: bool,
                              resumed: int | None = None) -> Any:
        """A torch DataPipe's iter(), before anything else is drawn, as torch's DataLoader
        treats one: an IterDataPipe's shared seed drawn (from torch's RNGs where the run's seed
        is torch's, before the base seed, at every iter(), persistent workers or not; from
        (seed, epoch) with seed=) and its shufflers seeded with it here, in the training
        process's copy; with 0 workers (`in_process`) its sharding filters set here for this
        process's rank.  Returns the seed as the epoch's stream key, which every worker applies
        to its own copy (EpochPlan.stream_key); None where the dataset is no IterDataPipe.
        `resumed`: the seed a state_dict() recorded for the epoch it resumes, used instead of
        the one drawn (drawn all the same, as the checkpointed iter() drew it)."""
        dataset = options.dataset
        if not is_datapipe(dataset):
            return None
        key = None
        if is_iter_datapipe(dataset):
            shared = (self._draw_datapipe_seed(options.seeds.generator) if options.derived.torch_seeded
                      else derived_seed(options.seeds.seed, epoch, _DATAPIPE_SEED_KEY))
            if resumed is not None:
                shared = resumed
            seed_datapipe(dataset, shared)
            key = np.array([shared], dtype=np.int64)
        if in_process:
            shard_datapipe(dataset, 1, 0, *datapipe_shards())
        return key

    def datapipe_workers_start(self, options: LoaderOptions) -> None:
        """Workers start for an IterDataPipe (a new iterator with workers: every iter() without
        persistent workers, the first with them): torch's iterator then resets itself at once,
        drawing a second shared seed after the base seed, which seeds the training process's
        copy only (its workers took the first).  Drawn here as well, so the program's later
        draws are the ones it gets with torch's loader."""
        if is_iter_datapipe(options.dataset) and options.derived.torch_seeded:
            seed_datapipe(options.dataset, self._draw_datapipe_seed(options.seeds.generator))

    def iteration_starts(self, options: LoaderOptions, epoch: int, keeps_workers: bool, generator: Any,
                         sampler: Any) -> tuple[int | None, int | None]:
        """An iter() of epoch `epoch` begins: draw what torch's iter() draws from torch's RNGs.
        Returns (the run's seed if it was drawn now, else None; the base seed of the workers
        this iteration starts, None where `keeps_workers`: persistent workers go on with theirs).
        torch's iterator draws its base seed when made, at every iter() but not again for
        persistent workers (it is reset, its workers go on); its RandomSampler (shuffle without
        a generator) draws its own seed from the global RNG after that, at the first batch.
        With seed= (nothing drawn from torch) each iteration's base seed follows from (seed,
        epoch)."""
        drawn = base = None
        if not (keeps_workers and self._base_drawn):
            if self.pending:
                drawn = base = self.draw(generator)
            else:
                base = (seed_from_torch(options.seeds.generator) if options.derived.torch_seeded
                        else derived_seed(options.seeds.seed, epoch))
                self._base_drawn = True
        if (options.derived.torch_seeded and options.own_sampler and isinstance(sampler, RandomSampler)
                and options.seeds.generator is None):
            seed_from_torch(None)   # what torch's RandomSampler draws (mxload's shuffles from `seed`)
        return drawn, base

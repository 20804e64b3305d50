"""The run's seed and each iteration's base seed.

The run's seed: given, drawn at the first ``iter()`` from torch's RNGs as
torch's DataLoader draws its base seed (the loader's generator, else the
global RNG, when the program imported torch), or fresh.  At every ``iter()``
what torch's ``iter()`` draws is drawn here too, in torch's order (the
iterator's base seed, then its RandomSampler's seed at the first batch), so
the program's later draws (its model's initialisation, dropout) are the ones
it gets with torch's loader.  The base seed drawn is the one the workers of
``seeding="torch"`` start from (``base_seed + worker id``, as torch's)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ._rng import derived_seed
from ._torch_compat import seed_from_torch
from .sampler import RandomSampler

if TYPE_CHECKING:
    from .dataloader import DataLoader


class RunSeed:
    def __init__(self, torch_seeded: bool):
        self.pending = torch_seeded   # drawn at the first iter(), as torch's
        self._base_drawn = False

    def draw(self, loader: DataLoader[Any]) -> None:
        """Draw the run's seed from torch (the loader's generator, or torch's global RNG): also the
        base seed of the first iteration's workers."""
        seed = seed_from_torch(loader.generator)
        self._base_drawn = True
        loader.seed = seed
        loader._options = dataclasses.replace(loader._options, base_seed=seed)
        if loader._options.own_sampler and isinstance(loader.sampler, RandomSampler):
            loader.sampler.seed = seed

    def iteration_starts(self, loader: DataLoader[Any]) -> None:
        """An iter() begins: draw what torch's iter() draws from torch's RNGs, and set the base seed
        of the workers it starts (``loader._options.base_seed``).  torch's iterator draws its base
        seed when made, at every iter() but not again for persistent workers (it is reset, its
        workers go on); its RandomSampler (shuffle without a generator) draws its own seed from the
        global RNG after that, at the first batch.  With seed= (nothing drawn from torch) each
        iteration's base seed follows from (seed, epoch)."""
        options = loader._options
        if not (loader.persistent_workers and loader.num_workers and self._base_drawn):
            if self.pending:
                self.draw(loader)
            else:
                base = (seed_from_torch(options.generator) if options.torch_seeded
                        else derived_seed(options.seed, loader.epoch))
                self._base_drawn = True
                loader._options = dataclasses.replace(loader._options, base_seed=base)
        if (options.torch_seeded and options.own_sampler and isinstance(loader.sampler, RandomSampler)
                and options.generator is None):
            seed_from_torch(None)   # what torch's RandomSampler draws (mxload's shuffles from `seed`)

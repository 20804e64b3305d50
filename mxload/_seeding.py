"""The run's seed: given, drawn at the first ``iter()`` from torch's RNGs as
torch's DataLoader draws its base seed (the loader's generator, else the
global RNG, when the program imported torch), or fresh.  And what torch's
``iter()`` draws, drawn here too, so the program's later draws (its model's
initialisation, dropout) are the ones it gets with torch's loader."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._torch_compat import seed_from_torch
from .sampler import RandomSampler

if TYPE_CHECKING:
    from .dataloader import DataLoader


class RunSeed:
    def __init__(self, torch_seeded: bool):
        self.pending = torch_seeded   # drawn at the first iter(), as torch's
        self._base_drawn = False

    def draw(self, loader: DataLoader[Any]) -> None:
        """Draw the run's seed from torch (the loader's generator, or torch's global RNG)."""
        seed = seed_from_torch(loader.generator)
        self._base_drawn = True
        loader.seed = seed
        if loader._options.own_sampler and isinstance(loader.sampler, RandomSampler):
            loader.sampler.seed = seed

    def torch_draws(self, loader: DataLoader[Any]) -> None:
        """What torch's iter() draws from torch's RNGs: its RandomSampler's
        seed from the global RNG (shuffle without a generator), then the
        iterator's base seed (not again for persistent workers), which seeds
        this run the first time."""
        options = loader._options
        if not options.torch_seeded:
            return
        if options.own_sampler and isinstance(loader.sampler, RandomSampler) and options.generator is None:
            seed_from_torch(None)   # what torch's RandomSampler draws (torch's own draws for itself)
        if loader.persistent_workers and loader.num_workers and self._base_drawn:
            return
        if self.pending:
            self.draw(loader)
        else:
            seed_from_torch(options.generator)
            self._base_drawn = True

# Which sample the calling thread loads, for mxload.sample_rng() (mxload/_rng.py).  A batch
# fetched sample by sample names each sample as it loads: with a tuple per sample that cost a
# tracked allocation and ~0.5 us a sample beyond torch's list comprehension (144 us of loop
# overhead a batch of 256, and a collector pass sooner); here it is two C stores.


cdef class SampleContext:
    """The sample loading in this thread: `seed`, `epoch`, `index` (None inside
    ``__getitems__``, a whole batch) and `load`, which changes at every sample's load
    (sample_rng's generators restart there, even for a sample loaded twice)."""
    cdef readonly object seed
    cdef readonly object epoch
    cdef readonly object index
    cdef readonly unsigned long long load

    def __cinit__(self, seed, epoch, index=None):
        self.seed = seed
        self.epoch = epoch
        self.index = index
        self.load = 0

    def fetch_each(self, getitem, list indices not None, seed_each=None):
        """[getitem(i) for i in indices], naming each sample here while it loads;
        `seed_each(i)` first where given (seeding="per_sample")."""
        cdef list samples = []
        cdef object i
        for i in indices:
            self.index = i
            self.load += 1
            if seed_each is not None:
                seed_each(i)
            samples.append(getitem(i))
        return samples

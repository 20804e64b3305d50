"""The loader's runtime: how a batch travels from the sampler to the consumer
with worker processes or threads (one module per stage)."""

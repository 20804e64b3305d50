"""Collation's private stages: ``plan`` (the planner, fields, BatchPlan,
collate into a buffer), ``layout`` (a batch's wire layout) and ``gathered``
(GatheredSamples, samples a dataset fetched as columns).  The public
batchify functions built on them are in :mod:`mxload.batchify`."""

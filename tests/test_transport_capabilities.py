"""A transport's optional capabilities (mxload/_runtime/transport.py: PutsTasks, ReceivesItself,
ClaimsRaw) are what it has, checked once: the engine binds them to its compiled window."""
from __future__ import annotations

import numpy as np
import pytest

import mxload
from mxload._runtime.transport import Capabilities, ClaimsRaw, PutsTasks, ReceivesItself, Transport

pytestmark = pytest.mark.timeout(60)


class Bare(Transport):
    """A transport with none of the optional capabilities (as Ray's)."""

    def __init__(self) -> None:
        pass

    start = dispatch = restart = pid = stop_receiving = refuse_starts = ask_to_stop = end_workers = \
        release = lambda self, *a: None


class Full(Bare):
    def __init__(self) -> None:
        self.put_task = lambda wid, task: False
        self.receive = lambda *a, **k: None
        self.claim_raw = lambda raw: None

    def claim_mismatch(self, raw, mismatch):
        return ValueError("mismatch")


def test_a_transport_has_the_capabilities_it_defines_and_no_other():
    bare = Capabilities.of(Bare())
    assert bare == Capabilities(None, None, None, None)
    full = Full()
    assert isinstance(full, PutsTasks) and isinstance(full, ReceivesItself) and isinstance(full, ClaimsRaw)
    got = Capabilities.of(full)
    assert (got.put_task, got.receive, got.claim_raw) == (full.put_task, full.receive, full.claim_raw)
    assert isinstance(got.claim_mismatch(None, None), ValueError)


@pytest.mark.parametrize("kwargs, receives", [(dict(num_workers=1), True),
                                              (dict(num_workers=1, thread_pool=True), False)])
def test_the_engine_binds_its_transport_s_capabilities_to_its_window(kwargs, receives):
    with mxload.DataLoader(mxload.ArrayDataset(np.arange(4)), batch_size=2, persistent_workers=True,
                           **kwargs) as loader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
        engine = loader._iterations.engine
        window, transport = engine.window, engine.transport
        assert window.put_task is transport.put_task   # both local transports put tasks compiled
        assert (window.receive is not None) is receives and (window.claim_raw is not None) is receives
        if receives:
            assert window.receive is transport.receive and window.claim_raw is transport.claim_raw

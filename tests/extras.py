"""torch for the tests that need it, imported at a test's first use of it, never when pytest
collects the test modules (NOTE [ torch last ] in conftest.py):

    torch = deferred("torch")            # torch.zeros(3) imports torch, in the test that calls it
    cases = deferred("torch_dropin_cases")   # a test module's torch datasets, in a module beside it

A test that uses one is marked `torch` (skipped without the extra, run after the others).
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any

TORCH_INSTALLED = importlib.util.find_spec("torch") is not None


class Deferred:
    """A module imported when a public attribute is first read from it.  Names starting with
    an underscore are not forwarded: pytest probes every object of a test module at collection
    (``_pytestfixturefunction``, ``__test__``, ``_mock_name``...), which must not import it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred(name: str) -> Any:
    """Module `name`, imported at the first attribute read (typed Any: what the module holds)."""
    return Deferred(name)

"""Every public name is documented (arguments, an example) and every example
in a docstring runs and prints what it shows."""
from __future__ import annotations

import doctest
import inspect

import pytest

import mxload
import mxload.batchify
import mxload.sampler

pytestmark = pytest.mark.timeout(120)

MODULES = {"mxload": mxload, "mxload.sampler": mxload.sampler, "mxload.batchify": mxload.batchify}


def public_names():
    for module_name, module in MODULES.items():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or name == "__version__":
                continue
            yield f"{module_name}.{name}", obj


def _takes_arguments(obj):
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return False
    return any(p.name != "self" for p in signature.parameters.values())


@pytest.mark.parametrize("name,obj", list(public_names()), ids=lambda x: x if isinstance(x, str) else "")
def test_public_name_has_a_docstring_with_arguments_and_an_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert len(doc) > 40, f"{name} has no real docstring"
    assert ">>>" in doc, f"{name}'s docstring has no example"
    if (inspect.isclass(obj) and not issubclass(obj, BaseException) or inspect.isfunction(obj)) \
            and _takes_arguments(obj):
        assert "Args:" in doc, f"{name}'s docstring does not describe its arguments"


def _examples():
    finder = doctest.DocTestFinder()
    seen = set()
    for module in MODULES.values():
        for name in module.__all__:
            obj = getattr(module, name)
            for test in finder.find(obj, name, module=False, globs={}):
                if test.examples and test.name not in seen:
                    seen.add(test.name)
                    yield test


@pytest.mark.parametrize("test", list(_examples()), ids=lambda t: t.name)
def test_docstring_examples_run(test):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {test.name} failed"

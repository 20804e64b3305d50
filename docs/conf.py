"""Sphinx configuration: the API reference comes from the docstrings
(autodoc + napoleon, Google style) of the installed mxload; the pages are
reStructuredText and Markdown (myst-parser).  Built with -W (warnings are
errors) by .ci/docs.sh and by the README's docs command, verbatim, in CI."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def _prefer_the_installed_mxload() -> None:
    """`python -m sphinx ... docs ...` run from the repository root puts the checkout first on
    sys.path, and its mxload/ has no compiled core unless it was built in place (`pip install
    -e .`): then document the installed package instead of failing to import."""
    if list((_CHECKOUT / "mxload").glob("_core.*.so")) or list((_CHECKOUT / "mxload").glob("_core.*.pyd")):
        return
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _CHECKOUT]
    if importlib.util.find_spec("mxload") is None:
        raise SystemExit("the docs document an installed mxload: `pip install \".[docs]\"` first")


_prefer_the_installed_mxload()
import mxload  # noqa: E402

project = "mxload"
author = "the mxload authors"
copyright = "the mxload authors, Apache-2.0"
release = version = mxload.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# mxload.torch is documented without torch installed (the docs extra does not pull a multi-GB
# torch build); its signatures name torch's classes, which autodoc then leaves as written.
autodoc_mock_imports = ["torch"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"          # types from the signatures, next to each argument
autodoc_class_signature = "separated"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True                    # "Attributes:" as fields, not duplicate objects
napoleon_use_rtype = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_title = f"mxload {release}"

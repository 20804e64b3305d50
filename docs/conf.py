"""Sphinx configuration: the API reference comes from the docstrings
(autodoc + napoleon, Google style) of the installed mxload; built with -W
(warnings are errors) by .ci/docs_and_examples.sh."""
from __future__ import annotations

import mxload

project = "mxload"
author = "the mxload authors"
copyright = "the mxload authors, Apache-2.0"
release = version = mxload.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
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

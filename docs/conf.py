"""Sphinx configuration of the optax_lossscale documentation.

Sphinx with MyST Markdown pages and sphinx-book-theme, as JAX, optax, Flax
and Orbax build theirs: the API reference comes from the docstrings
(autodoc, Google style through napoleon), and the pages are Markdown whose
code blocks the test suite runs (``tests/test_docs.py``). Build:
``python -m sphinx -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # the package, also when not installed

import optax_lossscale  # noqa: E402

project = "optax_lossscale"
author = "The optax_lossscale authors"
copyright = "2026, " + author  # noqa: A001
release = optax_lossscale.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "results/*.txt"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings say the types, in words
autodoc_default_options = {"members": False, "undoc-members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "sphinx_book_theme"
html_title = "optax_lossscale"
html_static_path = ["_static"]
html_css_files = ["layout.css"]  # the content column uses the page
html_theme_options = {
  "show_toc_level": 2,
  "home_page_in_toc": True,
}

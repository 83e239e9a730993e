"""Sphinx configuration of the asynchdf5 documentation (``nox -s docs`` builds it)."""

from __future__ import annotations

import importlib.metadata

project = "asynchdf5"
author = "asynchdf5 developers"
copyright = "asynchdf5 developers"
release = importlib.metadata.version("asynchdf5")
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# No intersphinx: the machines that build the docs reach only package registries, and an
# inventory that cannot be fetched is a warning, which -W turns into a failure.

# Markdown pages: ::: fences for directives, definition lists, anchors for headings down to ###.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The docstrings are numpydoc style; napoleon renders them without numpydoc's strict validation.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_param = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "separated"
# The PyTorch, Keras and JAX adapters are documented without installing them here.
autodoc_mock_imports = ["torch", "torchdata", "keras", "jax"]

html_theme = "furo"
html_title = f"asynchdf5 {release}"

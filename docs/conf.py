"""Sphinx configuration (MCore's docs use Sphinx with MyST markdown)."""

project = "megatron-core optimizer-state adoption"
author = "state-adoption contributors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "gpu-results/**", "mutation-results/**"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_type_aliases = {}
napoleon_google_docstring = True
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]

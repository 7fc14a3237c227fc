"""Sphinx configuration of the credit-parallel documentation.

Build with ``make docs`` (``sphinx-build -W --keep-going -q -b html docs docs/_build/html``):
warnings are errors. Nothing is mocked: the package and torch must be importable.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.parsers.rst.directives.images import Image
from sphinx.application import Sphinx

HERE = Path(__file__).resolve().parent

project = "credit-parallel"
author = "credit-parallel contributors"
copyright = "credit-parallel contributors"
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

# Google-style "Args:", "Returns:", "Raises:" sections.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
# "Attributes:" as fields of the class, not as entries that would duplicate autodoc's members.
napoleon_use_ivar = True

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}

# No network where the docs are built: intersphinx stays off, so torch names render as text.
exclude_patterns = ["_build", "examples"]
templates_path: list[str] = []

html_theme = "furo" if importlib.util.find_spec("furo") is not None else "alabaster"
html_title = "credit-parallel"

# credit.parallel.norm_report is optional: its page is built only when the module exists.
if not (HERE.parent / "src" / "credit" / "parallel" / "norm_report.py").exists():
    exclude_patterns.append("api/norm_report.rst")

BENCH_PLOT = "_static/bench.png"  # written by ``make bench``


class BenchPlot(Directive):
    """``.. bench-plot::``: the benchmark's plot once ``make bench`` has written it, else a note."""

    def run(self) -> list[nodes.Node]:
        # Rebuild the page when the plot appears or changes (a missing file always counts as new).
        self.state.document.settings.env.note_dependency(str(HERE / BENCH_PLOT))
        if (HERE / BENCH_PLOT).exists():
            image = Image(
                "image",
                [BENCH_PLOT],
                {"alt": "Benchmark of credit-parallel against torch"},
                self.content,
                self.lineno,
                self.content_offset,
                self.block_text,
                self.state,
                self.state_machine,
            )
            return image.run()
        note = "The plot appears here once make bench has written docs/" + BENCH_PLOT + "."
        return [nodes.paragraph(text=note)]


def _drop_builtin_type_docs(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """A constant such as a tuple inherits its type's docstring; the page's own text replaces it."""
    if what in ("data", "attribute") and getattr(type(obj), "__module__", None) == "builtins":
        lines.clear()


def setup(app: Sphinx) -> None:
    app.add_directive("bench-plot", BenchPlot)
    app.connect("autodoc-process-docstring", _drop_builtin_type_docs)

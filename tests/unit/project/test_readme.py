"""README.md describes main in a fixed order within its line budget, and every figure it quotes comes
from a benchmark's results file (benchmarks/results/*.json), which names the command that printed it."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
SECTIONS = [
    "What it is",
    "Install",
    "Quickstart: the CPU demo",
    "Quickstart: your model on GPUs",
    "Bring your own task",
    "Configuration and the run directory",
    "Operating a run",
    "The inference server alone",
    "Several hosts",
    "Development",
    "Benchmarks",
    "Documentation",
]
MAX_LINES = 220
# A measured figure: a percentage, a ratio (1.36x, 2.1×) or a duration in seconds, ranges included.
FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:%|x\b|×| s\b| ms\b)")


def _prose(text: str) -> str:
    """The README without its code blocks (commands and sample output, not claims)."""
    return re.sub(r"```.*?```", "", text, flags=re.DOTALL)


def test_readme_has_its_sections_in_order_within_the_line_budget() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    headings = re.findall(r"^## (.+)$", _prose(text), flags=re.MULTILINE)
    assert headings == SECTIONS


def test_the_figures_table_is_what_the_results_files_give() -> None:
    from benchmarks import page  # the checkout's root is on sys.path (pytest's rootdir)

    records = page.load_results(REPO / "benchmarks" / "results")
    assert README.read_text() == page.readme_with_figures(README.read_text(), records), (
        "README.md's figures table is not what benchmarks/results/ gives: run `python -m benchmarks.page`"
    )


def test_every_figure_in_the_readme_comes_from_a_results_file() -> None:
    held = "\n".join(
        json.dumps(json.loads(p.read_text()), ensure_ascii=False)
        for p in sorted((REPO / "benchmarks" / "results").glob("*.json"))
    )
    figures = FIGURE.findall(_prose(README.read_text()))
    assert figures, "the pattern found no figure at all: the check would pass on anything"
    missing = sorted({f for f in figures if f not in held})
    assert not missing, f"figures in README.md that no results file holds: {missing}"

"""The benchmarks page and the README's table of current figures, generated from the results files.

    .venv/bin/python -m benchmarks.page          # rewrite docs/benchmarks.md and README.md's table
    .venv/bin/python -m benchmarks.page --check  # exit 1 if either differs from what the results give

Every benchmark writes its latest result to benchmarks/results/<name>.json (common.publish) and calls
write_page; nothing on the page or in the README's table is typed by hand except the method text in
benchmarks/page_header.md. A goal's row names the command, date and machine of the run that measured it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.common import DEFAULT_DOC, README, RESULTS_DIR, cpu_of, render_table

HEADER = Path(__file__).with_name("page_header.md")
README_START, README_END = "<!-- figures:start -->", "<!-- figures:end -->"
# Page order: the order of benchmarks/run.py; a variant (vs-trl-25m) follows its benchmark.
ORDER = (
    "demo",
    "weight-sync",
    "inflight",
    "pipeline-vs-sync",
    "streams",
    "shim",
    "multihost",
    "recovery",
    "trainer-step",
    "vs-trl",
    "lag",
    "engine-profile",
    "warmup-seeds",
    "tracking-cost",
    "ray-cost",
    "lora-cost",
    "lora-demo",
    "rollout-strategies",
    "soak",
)


def load_results(results_dir: Path) -> list[dict]:
    """Every results file, in page order."""
    records = [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))]

    def key(record: dict) -> tuple[int, str]:
        name = record["name"]
        base = max((b for b in ORDER if name == b or name.startswith(b + "-")), key=len, default=None)
        return (ORDER.index(base) if base else len(ORDER), name)

    return sorted(records, key=key)


def render_section(record: dict, page_dir: Path) -> str:
    """One result as the page shows it."""
    quick = " (`--quick`: smoke-test sizes, NOT representative)" if record.get("quick") else ""
    lines = [
        f'<a id="{record["name"]}"></a>',
        f"### {record['title']}{quick}",
        "",
        f"`{record['command']}` on {record['date']}. Machine: {record['machine']}.",
        "",
    ]
    if record.get("intro"):
        lines += [record["intro"], ""]
    for table in record.get("tables", []):
        lines += [table["text"] if "text" in table else render_table(table["headers"], table["rows"]), ""]
    for goal in record.get("goals", []):
        lines.append(f"- **Goal — {goal['name']}: {goal['status'].upper()}.** {goal['detail']}")
    lines += list(record.get("notes", []))
    for image in record.get("images", []):
        rel = os.path.relpath(README.parent / image, page_dir)
        lines += ["", f"![{Path(image).stem}]({rel})"]
    return "\n".join(lines).rstrip() + "\n"


def figures_table(records: list[dict], link_prefix: str) -> str:
    """One row per goal of every (non-quick) result: the goal, its verdict and figures, the run."""
    rows = []
    for record in records:
        if record.get("quick"):
            continue
        run = f"[`{record['command']}`]({link_prefix}#{record['name']}), {record['date'][:10]}, {cpu_of(record['machine'])}"
        for goal in record.get("goals", []):
            rows.append([goal["name"], f"**{goal['status']}**: {goal['detail']}", run])
    return render_table(["goal", "result", "run (command, date, CPU)"], rows, pad=False)


def render_page(records: list[dict], page_dir: Path) -> str:
    header = HEADER.read_text().rstrip() if HEADER.exists() else "# Benchmarks"
    parts = [header, "", "## Current figures", "", figures_table(records, ""), "", "## Results", ""]
    parts += [render_section(record, page_dir) for record in records]
    return "\n".join(parts).rstrip() + "\n"


def readme_with_figures(readme_text: str, records: list[dict]) -> str:
    """README.md's text with the block between its figures markers regenerated."""
    if README_START not in readme_text or README_END not in readme_text:
        raise ValueError(f"README.md has no {README_START} ... {README_END} block for the figures table")
    head, rest = readme_text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    table = figures_table(records, "docs/benchmarks.md")
    return f"{head}{README_START}\n{table}\n{README_END}{tail}"


def write_page(results_dir: Path, doc_path: Path, readme: Path | None = README) -> None:
    """Regenerate the page (and, unless readme is None, README.md's figures table) from results_dir."""
    records = load_results(results_dir)
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    doc_path.write_text(render_page(records, doc_path.parent))
    if readme is not None:
        readme.write_text(readme_with_figures(readme.read_text(), records))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.page", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that both are up to date")
    args = parser.parse_args(argv)
    records = load_results(RESULTS_DIR)
    page = render_page(records, DEFAULT_DOC.parent)
    readme = readme_with_figures(README.read_text(), records)
    if args.check:
        stale = [p for p, text in ((DEFAULT_DOC, page), (README, readme)) if p.read_text() != text]
        if stale:
            sys.exit(f"out of date (run python -m benchmarks.page): {', '.join(map(str, stale))}")
        return
    DEFAULT_DOC.write_text(page)
    README.write_text(readme)
    print(f"wrote {DEFAULT_DOC} and the figures table of {README} from {len(records)} results")


if __name__ == "__main__":
    main()

"""Turns the fault suite's figures (`tests/faults/results/latest.json`, written by the tests)
into a table: on stdout, and with `--write` into `tests/faults/results/latest.md` (beside the
results, ignored by git): the run's date and machine and one row per test with its outcome and
figures. With `--update`, a run of some tests (`scripts/fault-test.sh -k …`) replaces only their
rows there: the table's other rows stay, and it says which run they come from.

A run never touches `docs/reliability.md`. That page quotes one dated run, and a maintainer
refreshes it deliberately with `--into-docs`, which copies the table of `latest.md` (or
`--table FILE`) into the page's figures section; the prose around it is written by hand.

    python3 tests/faults/report.py [--results FILE] [--table FILE] [--write [--update]]
    python3 tests/faults/report.py --into-docs [--table FILE]

Standard library only, so it runs without the test venv."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = Path(
    os.environ.get("KILNTAINERS_FAULTS_RESULTS") or REPO / "tests" / "faults" / "results" / "latest.json"
)
DOCS = REPO / "docs" / "reliability.md"

# The generated part of a page sits between these two lines; the prose around it is written by
# hand, so neither `--write` nor `--into-docs` overwrites it.
BEGIN = "<!-- fault-suite figures: written by tests/faults/report.py -->"
END = "<!-- end of fault-suite figures -->"
# What a new table file starts with, before its figures section.
TABLE_HEAD = """# Fault-suite figures

The latest run's figures, written by `scripts/fault-test.sh` (`tests/faults/report.py --write`).
Not tracked: `docs/reliability.md` quotes a run only when a maintainer copies this table there
with `python3 tests/faults/report.py --into-docs`.
"""


UNITS = {"_mib": " (MiB)", "_ms": " (ms)", "_seconds": " (s)"}


def format_key(key: str) -> str:
    for suffix, unit in UNITS.items():
        if key.endswith(suffix):
            return key[: -len(suffix)].replace("_", " ") + unit
    return key.replace("_", " ")


def format_value(value) -> str:
    if isinstance(value, dict) and len(value) > 3 and all(v == 0 for v in value.values()):
        return f"0 for each of {len(value)}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {format_value(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "; ".join(format_value(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def figures_text(figures: dict) -> str:
    return "; ".join(f"{format_key(key)} = {format_value(value)}" for key, value in figures.items())


def rows(data: dict) -> list[tuple[str, str, str, str, str]]:
    out = []
    def order(item: tuple[str, dict]) -> tuple[int, str]:
        scenario = item[1].get("scenario", "")
        return (int(scenario) if scenario.isdigit() else 1 << 30, item[0])

    for nodeid, entry in sorted(data.get("tests", {}).items(), key=order):
        test = nodeid.split("::", 1)[-1]
        outcome = entry.get("outcome", "?")
        if entry.get("message"):
            outcome += f" ({entry['message']})"
        out.append((entry.get("scenario", "?"), test, outcome, str(entry.get("duration_s", "")),
                    figures_text(entry.get("figures", {}))))
    return out


def machine_text(run: dict) -> str:
    parts = [
        f"run on {run.get('date', '?')}",
        f"{run.get('cores', '?')} × {run.get('cpu', '?')}",
        f"{run.get('memory_gib', '?')} GiB RAM",
        f"Linux {run.get('kernel', '?')}",
        f"Docker Engine {run.get('docker', '?')}",
        f"binary `{run.get('binary', '?')}` built {run.get('binary_built', '?')} from commit {run.get('commit', '?')}",
    ]
    return ", ".join(parts)


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


EARLIER = " are from an earlier run: "


@dataclass
class Earlier:
    """A table's generated section as `--update` reads it back."""

    machine: str  # the line naming the run and machine of its own rows
    rows: list[str]
    # Where rows come from an earlier run still: that run by scenario (all its rows) or by test.
    scenario_origins: dict[str, str]
    test_origins: dict[str, str]

    def origin(self, scenario: str, test: str) -> str:
        return self.test_origins.get(test) or self.scenario_origins.get(scenario) or self.machine


def by_scenario(numbers: set[str] | list[str]) -> list[str]:
    return sorted(set(numbers), key=lambda n: int(n) if n.isdigit() else 1 << 30)


def markdown(data: dict, kept: Earlier | None = None) -> str:
    """The generated section; `kept` = the table's earlier rows, of which those of tests this
    run did not run are carried over (`--update`), each group with the run it comes from."""
    lines = [BEGIN, "", machine_text(data.get("run", {})) + ".", ""]
    table = [(scenario, f"| {scenario} | `{escape_cell(test)}` | {escape_cell(outcome)} | {seconds} | {escape_cell(figs)} |")
             for scenario, test, outcome, seconds, figs in rows(data)]
    ran = {test for _, test, _, _, _ in rows(data)}
    carried: dict[str, list[tuple[str, str]]] = {}  # earlier run -> (scenario, test) of its rows
    if kept:
        for row in kept.rows:
            cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
            test = cells[1].strip("`") if len(cells) >= 2 else None
            if test is not None and test not in ran:
                table.append((cells[0], row))
                carried.setdefault(kept.origin(cells[0], test), []).append((cells[0], test))
        for origin, rows_of in carried.items():
            lines += [origin_note(origin, rows_of, [scenario for scenario, _ in table]), ""]
    table.sort(key=lambda item: int(item[0]) if item[0].isdigit() else 1 << 30)
    lines.append("| # | test | outcome | s | figures |")
    lines.append("|---|------|---------|---|---------|")
    lines += [row for _, row in table]
    shown = {entry.get("scenario") for entry in data.get("tests", {}).values()}
    shown.update(scenario for rows_of in carried.values() for scenario, _ in rows_of)
    missing = by_scenario(set(scenario_numbers()) - shown)
    if missing:
        lines += ["", f"Not run in this run: scenario {', '.join(missing)}."]
    lines += ["", END]
    return "\n".join(lines)


def origin_note(origin: str, rows_of: list[tuple[str, str]], table: list[str]) -> str:
    """The line naming the earlier run that the rows `rows_of` come from: by scenario where all
    of that scenario's rows in the table (its scenario column) do, else by test."""
    mine = [scenario for scenario, _ in rows_of]
    whole = by_scenario([n for n in mine if mine.count(n) == table.count(n)])
    single = [f"`{test}` (scenario {scenario})" for scenario, test in rows_of if scenario not in whole]
    parts = ([f"scenario {', '.join(whole)}"] if whole else []) + ([", ".join(single)] if single else [])
    return f"Rows of {' and of '.join(parts)}{EARLIER}{origin}"


def earlier_run(page: str) -> Earlier | None:
    """The machine line, table rows and rows' earlier runs of the page's generated section."""
    quoted = section(page)
    if quoted is None:
        return None
    lines = [line for line in quoted.splitlines() if line.strip()]
    machine = next((line for line in lines if line.startswith("run on ")), "?")
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| # ")]
    by_number: dict[str, str] = {}
    by_test: dict[str, str] = {}
    for line in lines:
        if line.startswith("Rows of ") and EARLIER in line:
            named, origin = line[len("Rows of "):].split(EARLIER, 1)
            whole = re.match(r"scenario ([0-9, ]+)", named)
            if whole:
                by_number.update((n.strip(), origin) for n in whole.group(1).split(",") if n.strip())
            by_test.update((test, origin) for test in re.findall(r"`([^`]+)`", named))
    return Earlier(machine, rows, by_number, by_test)


def scenario_numbers() -> list[str]:
    """The scenarios the suite has: one `test_s<n>_*.py` file each."""
    return [path.name[6:].split("_", 1)[0] for path in Path(__file__).parent.glob("test_s*_*.py")]


def splice(page: str, figures: str) -> str:
    """The page with its generated section replaced (or appended when it has none yet)."""
    if BEGIN in page and END in page:
        head, rest = page.split(BEGIN, 1)
        return head + figures + rest.split(END, 1)[1]
    return page.rstrip("\n") + "\n\n" + figures + "\n"


def section(page: str) -> str | None:
    """The generated section of a page, markers included, if it has one."""
    if BEGIN not in page or END not in page:
        return None
    return BEGIN + page.split(BEGIN, 1)[1].split(END, 1)[0] + END


def into_docs(table: Path, docs: Path) -> int:
    """Quotes the figures section of `table` in `docs`; says what it quoted and what it lacks."""
    quoted = section(table.read_text()) if table.exists() else None
    if quoted is None:
        print(f"no figures section in {table}; run scripts/fault-test.sh first", file=sys.stderr)
        return 1
    page = docs.read_text()
    if section(page) is None:
        print(f"{docs} has no figures section ({BEGIN} … {END})", file=sys.stderr)
        return 1
    docs.write_text(splice(page, quoted))
    earlier = earlier_run(quoted)
    assert earlier is not None
    print(f"quoted {len(earlier.rows)} rows in {docs}: {earlier.machine}")
    for line in quoted.splitlines():
        if line.startswith(("Rows of ", "Not run in this run")):
            print(f"  {line}")
    failed = [row for row in earlier.rows if "| passed |" not in row]
    if failed:
        print(f"  {len(failed)} rows did not pass: review them before committing the page")
    print("Now update the sentence above the table that names the run quoted, and review the diff.")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--table", type=Path, help="the markdown table file (default: the results file's name with .md)")
    parser.add_argument("--write", action="store_true", help="write the results' table into the table file")
    parser.add_argument("--update", action="store_true",
                        help="with --write: replace only the rows of the tests in the results, keep the table's others")
    parser.add_argument("--into-docs", action="store_true",
                        help=f"quote the table file's figures in {DOCS.relative_to(REPO)} (nothing else is read)")
    args = parser.parse_args()
    table = args.table or args.results.with_suffix(".md")
    if args.into_docs:
        if args.write or args.update:
            parser.error("--into-docs quotes a table written before; run --write on its own first")
        return into_docs(table, DOCS)
    if args.update and not args.write:
        parser.error("--update needs --write")
    if not args.results.exists():
        print(f"no results at {args.results}; run scripts/fault-test.sh", file=sys.stderr)
        return 1
    data = json.loads(args.results.read_text())
    print(machine_text(data.get("run", {})))
    for scenario, test, outcome, seconds, figs in rows(data):
        print(f"\n[{scenario}] {test}: {outcome} ({seconds} s)\n    {figs}")
    if args.write:
        page = table.read_text() if table.exists() else TABLE_HEAD
        kept = earlier_run(page) if args.update else None
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(splice(page, markdown(data, kept)))
        print(f"\nwrote {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

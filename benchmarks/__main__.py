"""Command line: ``python -m benchmarks [--quick] [--only NAME ...] [--write] ...``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import sys
import time
from pathlib import Path

from benchmarks import data, report, suite
from benchmarks.config import DEFAULT_DATA_DIR, QUICK, SuiteConfig
from benchmarks.measure import Result

RESULTS_MD = Path(__file__).parent / "RESULTS.md"


def _parser() -> argparse.ArgumentParser:
    full = SuiteConfig()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure asynchdf5 against the raw-read limit, the in-RAM ceiling, plain "
        "h5py and the PyTorch DataLoader, on data sets generated into --data-dir. Prints a "
        "markdown report.",
    )
    p.add_argument(
        "--quick", action="store_true", help="small data sets and budgets: a smoke test (< 1 min)"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only these data sets ({', '.join(n.name for n in full.datasets())}) "
        f"and/or groups ({', '.join(suite.GROUPS)}); repeatable or comma-separated",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help=f"where data sets are generated and reused (default {DEFAULT_DATA_DIR})",
    )
    p.add_argument(
        "--samples",
        type=int,
        help=f"samples of the image sets (default {full.image_samples:,}; --quick "
        f"{QUICK['image_samples']:,})",
    )
    p.add_argument(
        "--rows", type=int, help="rows of the tabular set (default: 4 x the image samples)"
    )
    p.add_argument(
        "--budget",
        type=float,
        help=f"seconds per bounded measurement (default {full.budget_s:g}; --quick "
        f"{QUICK['budget_s']:g})",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        help=f"samples per chunk for asynchdf5 and the chunk loop (default {full.chunk_size:,})",
    )
    p.add_argument(
        "--timeout",
        type=float,
        help=f"wall-clock limit of one measurement, s (default {full.timeout_s:g}; --quick "
        f"{QUICK['timeout_s']:g})",
    )
    p.add_argument("--write", action="store_true", help=f"also write the report to {RESULTS_MD}")
    p.add_argument("--output", type=Path, help="also write the report to this file")
    p.add_argument("--json", type=Path, help="also save the results as JSON to this file")
    p.add_argument(
        "--render", type=Path, metavar="JSON", help="render the report of a saved --json run again"
    )
    return p


def config_from(args: argparse.Namespace) -> SuiteConfig:
    """The suite configuration the arguments ask for."""
    base = SuiteConfig(data_dir=args.data_dir)
    if args.quick:
        base = dataclasses.replace(base, **QUICK)
    if args.samples is not None:
        base = dataclasses.replace(base, image_samples=args.samples, tabular_rows=4 * args.samples)
    if args.rows is not None:
        base = dataclasses.replace(base, tabular_rows=args.rows)
    if args.budget is not None:
        base = dataclasses.replace(base, budget_s=args.budget)
    if args.timeout is not None:
        base = dataclasses.replace(base, timeout_s=args.timeout)
    if args.chunk_size is not None:
        base = dataclasses.replace(base, chunk_size=args.chunk_size)
    only = tuple(n.strip() for item in args.only for n in item.split(",") if n.strip())
    known = {s.name for s in base.datasets()} | set(suite.GROUPS)
    unknown = [n for n in only if n not in known]
    if unknown:
        raise SystemExit(
            f"--only: unknown name(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return dataclasses.replace(base, only=only)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.render:
        info, files, results = report.load_json(args.render)
    else:
        info, files, results = run(config_from(args), argv)
    text = report.render(results, files, info)
    print(text)
    if args.write:
        report.write(text, RESULTS_MD)
    if args.output:
        report.write(text, args.output)
    if args.json and not args.render:
        report.save_json(args.json, info, files, results)
    return 0


def run(
    config: SuiteConfig, argv: list[str]
) -> tuple[report.RunInfo, list[data.DatasetFiles], list[Result]]:
    """Generate what is missing, run every selected measurement, and describe the run."""
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M")
    load_start = os.getloadavg()
    facts = report.collect_facts()
    t0 = time.perf_counter()
    named = [o for o in config.only if o not in suite.GROUPS]
    sets = [s for s in config.datasets() if not named or s.name in named]
    files = data.ensure(sets, config.data_dir)
    generated = time.perf_counter() - t0
    results = suite.run(files, config)
    info = report.RunInfo(
        argv=argv,
        started=started,
        wall_s=time.perf_counter() - t0,
        load_start=list(load_start),
        load_end=list(os.getloadavg()),
        generated_s=generated if generated > 1 else None,
        facts=facts,
    )
    return info, files, results


if __name__ == "__main__":
    sys.exit(main())

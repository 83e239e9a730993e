"""``python -m benchmarks list | run NAME... [--quick] [--out DIR] | report FILE|DIR...``.

``run`` runs each named benchmark (``all``: every one) in a fresh interpreter under a deadline,
so that one benchmark's threads, memory and failures stay its own; each writes ``OUT/NAME.json``
(:mod:`benchmarks.report`), and the markdown of the run is printed at the end. The exit status
is 1 when a benchmark failed (a skip with its reason is not a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from benchmarks import report
from benchmarks.data import DEFAULT_DATA_DIR
from benchmarks.registry import BENCHMARKS

DEFAULT_OUT = Path("bench-results")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the named benchmarks")
    run = sub.add_parser("run", help="run benchmarks, one JSON file each")
    for q in (run, one := sub.add_parser("_one", help=argparse.SUPPRESS)):
        q.add_argument("--quick", action="store_true", help="toy sizes: seconds each")
        q.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}/")
        q.add_argument(
            "--data-dir",
            type=Path,
            default=DEFAULT_DATA_DIR,
            help=f"where data sets are generated and reused (default {DEFAULT_DATA_DIR})",
        )
    run.add_argument("names", nargs="+", metavar="NAME", help="benchmark names, or all")
    run.add_argument(
        "--timeout", type=float, default=None, help="seconds per benchmark (60 quick, 3600)"
    )
    one.add_argument("name")
    one.add_argument("--command-line", default="")
    rep = sub.add_parser("report", help="markdown of result files")
    rep.add_argument("paths", nargs="+", type=Path, metavar="FILE|DIR")
    return p


def _names(asked: Sequence[str]) -> list[str]:
    names = list(BENCHMARKS) if "all" in asked else list(dict.fromkeys(asked))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(
            f"unknown benchmark(s) {', '.join(unknown)}; see python -m benchmarks list"
        )
    return names


def run_one(name: str, quick: bool, out: Path, data_dir: Path, command: list[str]) -> int:
    """Run one benchmark in this process and write its JSON file; 1 if it failed."""
    rec = report.Recorder(name, quick, data_dir)
    facts = report.machine()
    started = report.utc_now()
    t0 = time.perf_counter()
    skipped = error = None
    try:
        BENCHMARKS[name].function()(rec)
    except report.Skipped as exc:
        skipped = str(exc)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("benchmarks."):
            skipped = f"{exc.name} is not in this checkout"
        else:
            skipped = f"needs {exc.name}, which is not installed"
    except Exception as exc:  # a failed benchmark is a result file, not a crash
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    doc = report.result_doc(rec, command, started, time.perf_counter() - t0, facts, skipped, error)
    report.write(doc, out)
    return 1 if error else 0


def run_all(names: list[str], args: argparse.Namespace, command: list[str]) -> int:
    """Each benchmark in its own interpreter and session, under a deadline."""
    timeout = args.timeout or (60.0 if args.quick else 3600.0)
    failed = 0
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(report.REPO_ROOT), os.environ.get("PYTHONPATH")])
        )
    }
    for name in names:
        t0 = time.perf_counter()
        path = args.out / f"{name}.json"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks", "_one", name, "--out", str(args.out)]
        cmd += ["--data-dir", str(args.data_dir), "--command-line", shlex.join(command)]
        cmd += ["--quick"] if args.quick else []
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -1
        if rc != 0 and not path.exists():
            why = f"timed out after {timeout:.0f} s" if rc == -1 else f"exit status {rc}"
            rec = report.Recorder(name, args.quick, args.data_dir)
            doc = report.result_doc(
                rec, command, report.utc_now(), time.perf_counter() - t0, report.machine(),
                error=why,
            )  # fmt: skip
            report.write(doc, args.out)
        failed += rc != 0
        print(f"# {name}: {time.perf_counter() - t0:.1f} s, rc {rc}", file=sys.stderr, flush=True)
    print(report.markdown(report.load(args.out / f"{n}.json" for n in names)))
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "list":
        width = max(map(len, BENCHMARKS))
        for b in BENCHMARKS.values():
            print(f"{b.name:<{width}}  {b.summary}")
        return 0
    if args.command == "report":
        return report.main([str(p) for p in args.paths])
    if args.command == "_one":
        command = shlex.split(args.command_line) or ["python", "-m", "benchmarks", *argv]
        return run_one(args.name, args.quick, args.out, args.data_dir, command)
    return run_all(_names(args.names), args, ["python", "-m", "benchmarks", *argv])


if __name__ == "__main__":
    sys.exit(main())

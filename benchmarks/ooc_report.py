"""The markdown report of :mod:`benchmarks.out_of_core`, from its JSON-able figures."""

from __future__ import annotations

import shlex
from typing import Any


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def markdown(out: dict[str, Any]) -> str:
    """A header of run facts, one table row per reader pass, then the layers' own notes."""
    load0 = " / ".join(f"{x:.2f}" for x in out["load_avg_start"])
    load1 = " / ".join(f"{x:.2f}" for x in out["load_avg_end"])
    limit = out["limit_samples_per_s"]
    mb_s = None if limit is None else limit * 3080 / 1e6
    lines = [
        *out.get("machine", []),
        "",
        f"- command: `{shlex.join(out['command'])}` ({out['started_utc']} UTC, "
        f"{out['wall_s']:.0f} s)",
        f"- file: {out['file']} ({out['file_bytes'] / 1e9:.2f} GB, {out['samples']:,} samples, "
        f"{'reused' if out['file_reused'] else 'written now'}), "
        f"{out['file_over_limit']:.1f} x the memory limit",
        f"- layer properties beyond the defaults: {out.get('layer_props') or 'none'}",
        f"- load average (1/5/15 min): at start {load0}, at end {load1}; {out['cpus']} CPUs",
        f"- limit (the larger of {' and '.join(out['limit_from']) or 'nothing measured'}): "
        f"{_f(limit, ',.0f')} samples/s ({_f(mb_s, ',.0f')} MB/s)",
        "",
        "| reader | pass | samples/s | ÷ limit | CPU-s per GB | first batch s | peak RSS MiB "
        "(workers) | cgroup peak MiB | resident before | label entropy ÷ permutation |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for name, r in out["readers"].items():
        if r.get("error"):
            lines.append(f"| {name} | FAILED (rc {r.get('returncode')}) | | | | | | | | |")
            notes.append(f"- {name} failed: {r['error'].strip()[-400:]}")
            continue
        rss = f"{r['maxrss_mib']:.0f}"
        if r.get("workers_maxrss_mib"):
            rss += f" ({r['workers_maxrss_mib']:.0f})"
        no_group = "" if r["cgroup"].startswith("cgroup v") else " (no cgroup)"
        for i, p in enumerate(r["passes"]):
            first = p.get("first_batch_s", r.get("first_batch_s"))
            resident = r["resident_before"] if i == 0 else p.get("resident_before")
            mixing = p.get("mixing")
            lines.append(
                f"| {name} | {_pass_name(name, i)}{no_group} | {p['rate']:,.0f} "
                f"| {_f(p.get('ratio_to_limit'), '.2f')} "
                f"| {_f(r.get('cpu_s_per_gb'), '.2f') if i == 0 else '〃'} "
                f"| {_f(first, '.3f')} | {rss if i == 0 else '〃'} "
                f"| {_f(r.get('cgroup_peak_mib'), ',.0f') if i == 0 else '〃'} "
                f"| {_pct(resident)} "
                f"| {_f(mixing['ratio'], '.3f') if mixing else '—'} |"
            )
        notes.append(f"- {name}: {r['cgroup']}" + _group_note(r))
        if r["resident_before"] is not None and r["resident_before"] > 0.05:
            notes.append(
                f"  - {100 * r['resident_before']:.1f} % of the file stayed in the page cache "
                "after eviction (pages mapped or dirty elsewhere?): this reader did not start cold"
            )
        for w in r.get("warnings", []):
            notes.append(f"  - warning: {w}")
        if "stats" in r:
            s = r["stats"]
            notes.append(
                f"  - stats: read_paths {s['read_paths']}, chunk_rows {s['chunk_rows']:,}, "
                f"block_rows {s.get('block_rows')}, {s['chunks_read']} chunks, reader "
                f"{s['bytes_read'] / max(s['read_seconds'], 1e-9) / 1e6:,.0f} MB/s while "
                f"reading; bottleneck: {s['bottleneck']}"
            )
            if s.get("read_notes"):
                notes.append(f"  - read_notes: {s['read_notes']}")
    lines += [
        "",
        "Rates of the layer are whole epochs (epoch 1 from construction); of the bounded readers "
        "(torch_h5py, memmap), from the first batch on. CPU-s per GB: the child's user + system "
        "time (workers included) over the bytes delivered (3,080 per sample). Peak RSS: the "
        "child's (its libraries included); cgroup peak: what the group held (page cache "
        "included, libraries not: the child joins after importing them).",
        "",
        *notes,
    ]
    return "\n".join(lines)


def _pass_name(name: str, i: int) -> str:
    if name.startswith("layer"):
        return f"epoch {i + 1}"
    return "whole file" if name == "sequential" else "bounded"


def _group_note(r: dict[str, Any]) -> str:
    if "cgroup_peak_mib" not in r:
        return ""
    hits, kills = r.get("cgroup_limit_hits"), r.get("cgroup_oom_kills")
    return f"; limit reached {hits} times, OOM kills {kills}"

"""Summarise an ncu source-view CSV of one kernel (`ncu --section WarpStateStats --section
SourceCounters --page source --print-source sass --csv ...`, gzip or plain): warp-stall samples
by reason, and the SASS instructions that hold the most samples with their top reasons. No GPU
needed: it reads the file ncu wrote on the GPU machine."""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    """The per-instruction rows: those after the "Address" header whose address is one (ncu and
    the profiled program print their own lines before and between)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = raw.decode().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit(f"{path}: no \"Address\" header: not an ncu --page source --csv file")
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    return [r for r in rows if (r.get("Address") or "").startswith("0x")]   # not log lines


def summarise(rows: list[dict], top: int = 20) -> str:
    reasons = [c for c in rows[0] if c.startswith("stall_") and "(Not Issued)" not in c]
    samples = lambda r: int(r["Warp Stall Sampling (All Samples)"] or 0)
    total = sum(samples(r) for r in rows)
    if total == 0:
        return "no stall samples in this file"
    by_reason = collections.Counter()
    for r in rows:
        for c in reasons:
            by_reason[c] += int(r[c] or 0)
    executed = sum(int(r["Instructions Executed"] or 0) for r in rows)
    out = [f"{len(rows)} SASS instructions, {executed} warp instructions executed, "
           f"{total} stall samples", "", "samples by reason:"]
    out += [f"  {c[6:]:20s} {v:7d} {v / total:6.1%}" for c, v in by_reason.most_common() if v]
    out += ["", f"top {top} instructions by samples (index, SASS, samples, executions, reasons):"]
    for i, r in sorted(enumerate(rows), key=lambda ir: -samples(ir[1]))[:top]:
        best = sorted(((c[6:], int(r[c] or 0)) for c in reasons), key=lambda kv: -kv[1])
        why = ", ".join(f"{c} {v}" for c, v in best[:3] if v)
        out.append(f"  {i:5d} {r['Source'].strip()[:48]:48s} {samples(r):5d} "
                   f"{r['Instructions Executed']:>8s}  {why}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("csv", type=Path, help="ncu --page source --csv output (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=20, help="instructions to list")
    args = p.parse_args(argv)
    print(summarise(read_rows(args.csv), args.top))


if __name__ == "__main__":
    main()

"""Summarise an ncu source-view CSV of one kernel (`ncu --section WarpStateStats --section
SourceCounters --page source --print-source sass --csv ...`, gzip or plain): warp-stall samples
by reason, and the SASS instructions that hold the most samples with their top reasons. No GPU
needed: it reads the file ncu wrote on the GPU machine."""

from __future__ import annotations

import collections
import csv
import gzip
import io
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cupool.cli import CLIParser, existing_file, positive_int, run  # noqa: E402 (after the path)

COLUMNS = ("Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")


def read_rows(path: Path) -> list[dict]:
    """The per-instruction rows: those after the "Address" header whose address is one (ncu and
    the profiled program print their own lines before and between)."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: not a gzip file ({e})") from None
    try:
        lines = raw.decode().splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file (an ncu --csv file, or one gzip-compressed "
                         f"with a .gz name)") from None
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError(f"{path}: no \"Address\" header: not an ncu --page source --csv file")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"{path}: no column {missing[0]!r}: run ncu with --section "
                         f"WarpStateStats --section SourceCounters")
    rows = [r for r in reader if (r.get("Address") or "").startswith("0x")]   # not log lines
    if not rows:
        raise ValueError(f"{path}: no instruction rows after the \"Address\" header")
    return rows


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


def build_parser() -> CLIParser:
    p = CLIParser(prog="ncu_source.py", description=__doc__)
    p.add_argument("csv", type=existing_file, help="ncu --page source --csv output (.csv or .csv.gz)")
    p.add_argument("--top", type=positive_int, default=20, help="instructions to list (>= 1)")
    return p


def main(args) -> None:
    print(summarise(read_rows(args.csv), args.top))


if __name__ == "__main__":
    sys.exit(run(main, build_parser()))

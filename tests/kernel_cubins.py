"""sha256 of each kernel's cubin in the builds the launchers compile (nvcc -arch=sm_90, no GPU).

A refactor of `rawkernels/` that must leave the kernels as they are is checked by comparing these
hashes before and after: `python tests/kernel_cubins.py > before.txt`, edit, then
`python tests/kernel_cubins.py --compare before.txt` (exit code 1 on any difference; builds
the earlier file lacks are listed as new).
The builds are `kernel_builds.BUILDS` (sm_90: the architecture the kernels are tuned on).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # run as a script or imported by tests
from kernel_builds import BUILDS, compile_many  # noqa: E402


def cubin_hashes(nvcc: str) -> list[tuple[str, str, str]]:
    """[(source, defines, sha256 of the sm_90 cubin)] for every build in BUILDS."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        results = compile_many(nvcc, [(name, d, 90) for name, d in BUILDS], Path(tmp))
        for i, ((name, defines), r) in enumerate(zip(BUILDS, results)):
            if r.returncode:
                digest = "compile-failed"
                print(f"{name} {defines}: {r.stderr.strip()}", file=sys.stderr)
            else:
                digest = hashlib.sha256((Path(tmp) / f"{i}.cubin").read_bytes()).hexdigest()
            out.append((name, defines, digest))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", metavar="FILE", help="an earlier output of this script")
    args = p.parse_args(argv)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("kernel_cubins: nvcc is not on PATH", file=sys.stderr)
        return 2
    rows = cubin_hashes(nvcc)
    if not args.compare:
        for name, defines, digest in rows:
            print(f"{digest}  {name}  {defines}")
        return 0
    old = {}
    for line in Path(args.compare).read_text().splitlines():
        digest, name, *rest = line.split("  ")
        old[(name, rest[0] if rest else "")] = digest
    differ = 0
    for name, defines, digest in rows:
        before = old.get((name, defines))
        if before is None:                   # a build the earlier file did not have
            print(f"new      {name:<12} {'':16}  {digest[:16]}  {defines}")
            continue
        same = before == digest
        differ += not same
        print(f"{'same   ' if same else 'DIFFERS'}  {name:<12} {before[:16]}  {digest[:16]}  {defines}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

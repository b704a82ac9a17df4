"""Compare the SASS of two cubin caches, variant by variant (no GPU needed).

A refactor or an opt-in knob should leave every other variant's binary as it was; this proves it offline: each
variant built in both caches (same name and parameters) is disassembled with cuobjdump and its instructions compared
(addresses and encodings included, comments and blank lines not). Prints the variants that differ and a count.

  python scripts/sass_diff.py OLD_CACHE NEW_CACHE [--name sm90.grouped_gemm]

cuobjdump comes from PATH, else $CUOBJDUMP, else /usr/local/cuda/bin/cuobjdump.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def cuobjdump() -> str:
    tool = shutil.which("cuobjdump") or os.environ.get("CUOBJDUMP") or "/usr/local/cuda/bin/cuobjdump"
    if not Path(tool).exists():
        raise SystemExit("cuobjdump not found: put it on PATH or name it in $CUOBJDUMP")
    return tool


def entries(cache: Path, name: str | None) -> dict[str, Path]:
    """{variant description: its cubin} of a cache (the entries' JSON names the cubin by its SHA-256).

    A cache that holds builds of two source trees (an A/B's) has two entries for a variant whose sources differ:
    which one to compare would be a guess, so that is refused."""
    out, seen = {}, {}
    for path in sorted((cache / "entries").rglob("*.json")):
        entry = json.loads(path.read_text())
        variant = entry["variant"]
        if name and variant["name"] != name:
            continue
        params = ",".join(f"{k}={v}" for k, v in sorted(dict(variant["params"]).items()))
        cubins = sorted((cache / "objects").glob(entry["cubin_sha256"] + "*"))
        if cubins:
            key = f"{variant['name']}[{params}] {entry.get('arch', '')}".strip()
            if key in out and seen[key] != entry["cubin_sha256"]:
                raise SystemExit(f"{cache}: two builds of {key} (two source trees' entries in one cache?): compare "
                                 f"caches built from one tree each")
            out[key], seen[key] = cubins[0], entry["cubin_sha256"]
    return out


def instructions(tool: str, cubin: Path) -> list[str]:
    listing = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return INSTRUCTION.findall(listing)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--name", default=None, help="only variants of this kernel name (e.g. sm90.grouped_gemm)")
    args = ap.parse_args()
    tool = cuobjdump()
    old, new = entries(args.old, args.name), entries(args.new, args.name)
    both = sorted(set(old) & set(new))
    differ = [key for key in both if instructions(tool, old[key]) != instructions(tool, new[key])]
    for key in differ:
        print(f"differs: {key}")
    print(f"{len(both)} variants in both caches, {len(differ)} differ; {len(set(new) - set(old))} only in the new one, "
          f"{len(set(old) - set(new))} only in the old one")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

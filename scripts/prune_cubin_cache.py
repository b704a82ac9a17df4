"""Drop the cubin cache's stale entries (built from kernel sources other than this tree's) and the objects no entry
references any more, so the cache that travels to a GPU machine holds this tree's builds only; or copy its current
entries with their cubins alone (the runtime loads no PTX; the PTX is two thirds of the cache) for a GPU machine.

    python scripts/prune_cubin_cache.py [--cache-dir DIR] [--dry-run]
    python scripts/prune_cubin_cache.py --runtime-copy .cubin-run    (then GC_MOE_CACHE_DIR=.cubin-run there)

An entry is stale when its key is not the key this tree computes for its variant (`jit.lookup_key`: the sources,
the DSL version, the compile options), or when its cubin is missing (an interrupted build; the runtime skips such an
entry and a build writes it again). No GPU and no DSL needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from gc_moe.runtime import jit


def stale_entries(cache_dir: Path) -> tuple[list[Path], set[str]]:
    """(the stale entries' files, the object names the current entries reference)."""
    stale, keep = [], set()
    for path in sorted((cache_dir / "entries").rglob("*.json")):
        entry = jit.CacheEntry.from_json(json.loads(path.read_text()), cache_dir)
        if path.stem == jit.lookup_key(entry.variant, entry.arch) and entry.cubin_path.is_file():
            keep |= {entry.cubin_path.name, entry.ptx_path.name}
        else:
            stale.append(path)
    return stale, keep


def runtime_copy(cache_dir: Path, dest: Path, stale: set, keep: set) -> int:
    """The current entries and their cubins (no PTX) into the new folder `dest`."""
    if dest.exists():
        raise SystemExit(f"{dest} exists: remove it first (a runtime copy is written whole, never merged)")
    entries = [p for p in sorted((cache_dir / "entries").rglob("*.json")) if p not in stale]
    for p in entries:
        (dest / p.relative_to(cache_dir)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest / p.relative_to(cache_dir))
    (dest / "objects").mkdir(parents=True)
    cubins = [cache_dir / "objects" / n for n in sorted(keep) if n.endswith(".cubin")]
    for p in cubins:
        shutil.copy2(p, dest / "objects" / p.name)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{len(entries)} entries and {len(cubins)} cubins copied to {dest}: {size / 2**20:.1f} MiB")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="the cache (default: $GC_MOE_CACHE_DIR or jit's)")
    ap.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    ap.add_argument("--runtime-copy", type=Path, default=None,
                    help="instead: write the current entries and their cubins (no PTX) to this new folder")
    args = ap.parse_args()
    cache_dir = args.cache_dir or jit.default_cache_dir()
    if not (cache_dir / "entries").is_dir():
        raise SystemExit(f"{cache_dir} holds no cubin cache (no entries/ folder)")
    stale, keep = stale_entries(cache_dir)
    if args.runtime_copy is not None:
        return runtime_copy(cache_dir, args.runtime_copy, set(stale), keep)
    objects = [p for p in sorted((cache_dir / "objects").glob("*")) if p.name not in keep]
    freed = sum(p.stat().st_size for p in stale + objects)
    print(f"{len(stale)} stale entries, {len(objects)} unreferenced objects, {freed / 2**20:.1f} MiB"
          + (" (dry run: nothing deleted)" if args.dry_run else " deleted"))
    if not args.dry_run:
        for p in stale + objects:
            p.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

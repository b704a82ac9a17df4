#!/usr/bin/env bash
# Same-run A/B of the grouped GEMM: this tree against an earlier one, on one GPU, rounds alternating old / new so
# drift and the card's warm-up fall on both sides. Run-to-run differences on one card reach 1-2%, so a kernel change
# predicted at that size is judged here, not against an earlier run's table.
#   OLD=DIR OUT=DIR bash scripts/gemm_ab.sh [ROUNDS] [bench arguments...]
# OLD: a checkout of the earlier tree (`git archive REV | tar -x -C DIR`); its variants built into the same cubin
# cache as this tree's (`PYTHONPATH=DIR/operator:DIR python DIR/scripts/bench_grouped_gemm_sm90.py --build-only ...`
# with the same GC_MOE_CACHE_DIR: the cache keys hold the kernel sources' hash, so both builds sit side by side).
# Bench arguments default to the 16-256 token points of tile_knobs's default; ROUNDS defaults to 2. Prints, per
# point and set, each side's median cold time over the rounds and the change.
set -u
cd "$(dirname "$0")/.."
: "${OLD:?OLD: the directory of the earlier tree}"
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export GC_MOE_CACHE_DIR=${GC_MOE_CACHE_DIR:-$PWD/.cubin-cache} GC_MOE_WAIT_TIMEOUT_S=${GC_MOE_WAIT_TIMEOUT_S:-30}
source scripts/steps.sh
ROUNDS=${1:-2}; shift $(( $# > 0 ? 1 : 0 ))
ARGS=("$@"); [ ${#ARGS[@]} -gt 0 ] || ARGS=(--check --time --auto-ctas --tokens 16,32,64,128,256 --windows 5 --replays 10)
NEW=$PWD
for r in $(seq "$ROUNDS"); do
  for side in old new; do
    tree=$NEW; [ "$side" = old ] && tree=$(cd "$OLD" && pwd)
    PYTHONPATH="$tree/operator:$tree" run "$side-$r" 240 python "$tree/scripts/bench_grouped_gemm_sm90.py" "${ARGS[@]}" \
      --json "$OUT/ab-$side-$r.json"
  done
done
python - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
times, tiles, failed = {}, {}, set()
for side in ("old", "new"):
    for r in range(1, rounds + 1):
        path = out / f"ab-{side}-{r}.json"
        if not path.exists():
            print(f"{path.name}: missing (its step failed or ran out of time)")
            continue
        for row in json.loads(path.read_text())["rows"]:
            key = (row["model"], row["tokens"], row["tag"])
            times.setdefault(key, {}).setdefault(side, []).append(row["cold_us"])
            tiles.setdefault(key, set()).add(row["block_n"])
            if not row.get("ok", True):
                failed.add(key)
print(f"{'model':20s} {'T':>4s} {'set':12s} {'tile':>6s} {'old us':>8s} {'new us':>8s} {'change':>8s}")
for key, sides in sorted(times.items()):
    if "old" not in sides or "new" not in sides:
        continue
    old, new = statistics.median(sides["old"]), statistics.median(sides["new"])
    tile = "/".join(str(t) for t in sorted(tiles[key]))
    print(f"{key[0]:20s} {key[1]:4d} {key[2]:12s} {tile:>6s} {old:8.1f} {new:8.1f} {100 * (new / old - 1):+7.2f}%"
          + ("  CHECK FAILED" if key in failed else ""))
PY
print_steps

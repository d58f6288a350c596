# Sourced by the plant scripts, first: from the repository root, PY the interpreter (python3 unless set).
# Each plant replaces one text of one source file (found there exactly once) before its check runs; the
# original comes back before the next plant and on exit.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
plant_begin() {   # plant_begin FILE [FILE...]: keep the files' originals (a plant's text is found in one of them)
  PLANT_SRCS=("$@")
  PLANT_ORIG=$(mktemp -d /tmp/plant_orig.XXXXXX)
  local f
  for f in "${PLANT_SRCS[@]}"; do mkdir -p "$PLANT_ORIG/$(dirname "$f")"; cp "$f" "$PLANT_ORIG/$f"; done
  trap 'plant_restore' EXIT
}
plant_restore() {
  local f
  for f in "${PLANT_SRCS[@]}"; do cp "$PLANT_ORIG/$f" "$f"; done
}
plant_apply() {   # plant_apply FROM TO: the originals, with FROM (found exactly once in all of them) replaced by TO
  plant_restore
  FROM="$1" TO="$2" "${PY:-python3}" - "${PLANT_SRCS[@]}" <<'PYEOF'
import os, sys
texts = {p: open(p).read() for p in sys.argv[1:]}
hits = [p for p, s in texts.items() for _ in range(s.count(os.environ["FROM"]))]
assert len(hits) == 1, f"plant text not found once in {sys.argv[1:]}: {os.environ['FROM']!r}"
open(hits[0], "w").write(texts[hits[0]].replace(os.environ["FROM"], os.environ["TO"]))
PYEOF
}
plant_loop() {   # plant_loop RUNNER CAUGHT: runs RUNNER (python; prints "RESULT passed" / "RESULT failed...")
  # (PLANT_ONLY=TEXT: only the plants whose name contains TEXT)
  # unplanted, then once per entry "name@from@to" of PLANTS; a plant is caught when the RESULT line
  # starts with CAUGHT. Returns the plants missed (99: the unplanted run did not pass).
  local runner=$1 caught=$2 base out line name from to missed=0
  base=$($PY "$runner" 2>&1 | grep "^RESULT" | tail -1)
  echo "[plant] no plant: ${base#RESULT }"
  [[ "$base" == "RESULT passed" ]] || { echo "[plant] the unplanted code must pass first"; return 99; }
  for p in "${PLANTS[@]}"; do
    IFS='@' read -r name from to <<<"$p"
    if [[ -n "${PLANT_ONLY:-}" && "$name" != *"$PLANT_ONLY"* ]]; then continue; fi   # a subset, by name
    plant_apply "$from" "$to" || return 98
    out=$($PY "$runner" 2>&1)
    line=$(echo "$out" | grep "^RESULT" | tail -1)
    if [[ "$line" == "$caught"* ]]; then echo "[plant] $name: caught (${line#RESULT })"
    else echo "[plant] $name: NOT caught (${line:-no result: $(echo "$out" | tail -3)})"; missed=$((missed + 1)); fi
  done
  return $missed
}
plant_world_case() {   # plant_world_case MODULE CASE: plant_loop over one case of a 2-process GPU world
  # (tests/worlds.py run_world on tests/gpu/MODULE.py's case_CASE); a world that dies or hangs fails too
  local runner=/tmp/plant_world_$2.py
  cat >"$runner" <<PYEOF
import sys
sys.path.insert(0, "$PWD/tests")
sys.path.insert(0, "$PWD/tests/gpu")
from worlds import run_world
if __name__ == "__main__":
    try:
        err = run_world(2, "$1", ["$2"], use_gpu=True, group_backend="gloo", timeout_s=200,
                        case_timeout_s=150)["$2"]
    except RuntimeError as e:   # a rank died (a planted store past the buffer) or hung: failed as well
        err = f"the world failed: {e}"
    print("RESULT", "passed" if err is None else "failed: " + err.strip().splitlines()[-1][:300])
PYEOF
  plant_loop "$runner" "RESULT failed"
}

# Sourced by the plant scripts: each plant replaces one text of one source file (found there exactly
# once) before its check runs; the original comes back before the next plant and on exit.
plant_begin() {   # plant_begin FILE: keep FILE's original
  PLANT_SRC=$1
  PLANT_ORIG=$(mktemp /tmp/plant_orig.XXXXXX)
  cp "$PLANT_SRC" "$PLANT_ORIG"
  trap 'cp "$PLANT_ORIG" "$PLANT_SRC"' EXIT
}
plant_apply() {   # plant_apply FROM TO: the original with FROM replaced by TO
  cp "$PLANT_ORIG" "$PLANT_SRC"
  FROM="$1" TO="$2" "${PY:-python3}" - "$PLANT_SRC" <<'PYEOF'
import os, sys
p = sys.argv[1]; s = open(p).read()
assert s.count(os.environ["FROM"]) == 1, f"plant text not found once: {os.environ['FROM']!r}"
open(p, "w").write(s.replace(os.environ["FROM"], os.environ["TO"]))
PYEOF
}
plant_loop() {   # plant_loop RUNNER CAUGHT: runs RUNNER (python; prints "RESULT passed" / "RESULT failed...")
  # unplanted, then once per entry "name@from@to" of PLANTS; a plant is caught when the RESULT line
  # starts with CAUGHT. Returns the plants missed (99: the unplanted run did not pass).
  local runner=$1 caught=$2 base out line name from to missed=0
  base=$($PY "$runner" 2>&1 | grep "^RESULT" | tail -1)
  echo "[plant] no plant: ${base#RESULT }"
  [[ "$base" == "RESULT passed" ]] || { echo "[plant] the unplanted code must pass first"; return 99; }
  for p in "${PLANTS[@]}"; do
    IFS='@' read -r name from to <<<"$p"
    plant_apply "$from" "$to" || return 98
    out=$($PY "$runner" 2>&1)
    line=$(echo "$out" | grep "^RESULT" | tail -1)
    if [[ "$line" == "$caught"* ]]; then echo "[plant] $name: caught (${line#RESULT })"
    else echo "[plant] $name: NOT caught (${line:-no result: $(echo "$out" | tail -3)})"; missed=$((missed + 1)); fi
  done
  return $missed
}

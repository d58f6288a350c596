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

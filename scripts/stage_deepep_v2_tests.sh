#!/usr/bin/env bash
# Stage DeepEP V2's own test files, unchanged, into an ignored folder of this checkout (nothing of
# DeepEP is committed):
#
#   bash scripts/stage_deepep_v2_tests.sh DEEPEP_GIT_DIR [REV] [DEST]
#
# DEEPEP_GIT_DIR  a clone or bare mirror of deepseek-ai/DeepEP (REV default HEAD: its V2 layout)
# DEST            default .deepep_v2_tests of this checkout; it gets
#   tests/elastic/test_{ep,barrier,agrs,engram,pp}.py, tests/utils/test_gate.py   V2's test files
#   support/deep_ep/utils/{refs,gate,testing}.py   V2's test-support modules (its reference
#       dispatch / combine, routing generator, profiler timer), pure Python; deep_ep.utils extends
#       its path over support/ (pkgutil.extend_path), so these three come from V2 and everything
#       else of deep_ep from commlib
#   COMMIT   the DeepEP commit staged
set -eu
SRC=${1:?usage: stage_deepep_v2_tests.sh DEEPEP_GIT_DIR [REV] [DEST]}
REV=${2:-HEAD}
cd "$(dirname "$0")/.."
DEST=${3:-.deepep_v2_tests}
FILES="tests/elastic/test_ep.py tests/elastic/test_barrier.py tests/elastic/test_agrs.py
tests/elastic/test_engram.py tests/elastic/test_pp.py tests/utils/test_gate.py"
SUPPORT="refs gate testing"
mkdir -p "$DEST/tests/elastic" "$DEST/tests/utils" "$DEST/support/deep_ep/utils"
for f in $FILES; do git -C "$SRC" show "$REV:$f" >"$DEST/$f"; done
for m in $SUPPORT; do git -C "$SRC" show "$REV:deep_ep/utils/$m.py" >"$DEST/support/deep_ep/utils/$m.py"; done
git -C "$SRC" rev-parse "$REV" >"$DEST/COMMIT"
echo "staged DeepEP $(cat "$DEST/COMMIT") into $DEST"

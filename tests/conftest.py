import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A developer's own tuning cache must not change the configs tests run with.
import tempfile  # noqa: E402

os.environ["COMMLIB_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(prefix="commlib-tune-"), "tuning.json")

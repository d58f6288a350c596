"""Long run (1,000 rounds), property-based routing, nothing-lost invariant: one 4-rank CPU world."""
import os

from worlds import run_world


def test_stress_world():
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(4, "cases_stress", ["property", "long_run"], timeout_s=900)
    for name, err in results.items():
        assert err is None, f"{name}: {err}"

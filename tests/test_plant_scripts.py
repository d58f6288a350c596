"""The GPU plant scripts (scripts/plant_*.sh) still plant what they say: each plant's text is found
exactly once in the files its script plants into, so a refactor that moves the code makes this fail
here, on CPU, instead of in a device run."""
from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("plant_*.sh") if re.search(r"^plant_begin ", p.read_text(), re.M))


def plants(script: pathlib.Path) -> tuple[list, list]:
    """(files of its plant_begin line, [(name, text)] of its PLANTS array)."""
    text = script.read_text()
    begin = re.search(r"^plant_begin (.+)$", text, re.M)
    array = re.search(r"^PLANTS=\(\n(.*?)^\)", text, re.M | re.S)
    assert begin and array, f"{script.name}: no plant_begin line or PLANTS array"
    entries = shlex.split(array.group(1), comments=True)
    return shlex.split(begin.group(1)), [tuple(e.split("@")[:2]) for e in entries]


def test_scripts_found():
    assert {p.name for p in SCRIPTS} >= {"plant_callpath.sh", "plant_callpath_internode.sh", "plant_internode_kernels.sh",
                                        "plant_fanout_windows.sh", "plant_fanout_sync.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_plant_text_found_once(script):
    files, entries = plants(script)
    sources = [(ROOT / f).read_text() for f in files]
    assert entries, f"{script.name}: no plants"
    for name, text in entries:
        hits = sum(s.count(text) for s in sources)
        assert hits == 1, f"{script.name}: plant {name!r}: its text is found {hits} times in {files}: {text!r}"

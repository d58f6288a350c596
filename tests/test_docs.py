"""The docs against the tree: the environment-variable page lists exactly what commlib/utils/env.py
reads, relative links resolve, the README stays a README, and committed results are cited and named
``<tool>_<gpu>x<n>_<yyyymmdd>_<commit>.<ext>``. Parsed, nothing imported or run."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV_PY = ROOT / "commlib" / "utils" / "env.py"
ENV_PAGE = ROOT / "docs" / "environment.md"
RESULTS = "benchmarks/results"
VAR = re.compile(r"COMMLIB_[A-Z0-9_]+")
# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
RESULT_NAME = re.compile(
    r"(?P<tool>[a-z][a-z0-9_]*?)_(?P<gpu>[A-Z][A-Za-z0-9]*)x(?P<n>[1-9][0-9]*)_(?P<date>20[0-9]{6})"
    r"_(?P<commit>[0-9a-f]{7,40})\.(?:json|png|log|txt)")


def env_variables_read(source: str) -> set:
    """Names of the COMMLIB_* variables env.py reads: string constants that are exactly a variable
    name (arguments of its getters, or the names it loops over); docstrings and the text of error
    messages do not count."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            for part in node.values:  # f-string text pieces are error messages, not reads
                docstrings.add(id(part))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                and VAR.fullmatch(node.value)):
            names.add(node.value)
    return names


def env_page_variables(text: str) -> set:
    """Variables in the first column of the page's table rows (``| `COMMLIB_X` | ... |``)."""
    names = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.lstrip().startswith("|") and cells and VAR.fullmatch(cells[0].strip("`")):
            names.add(cells[0].strip("`"))
    return names


def doc_files() -> list:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def broken_links(path: Path) -> list:
    """Relative link targets in ``path`` that name no existing file or folder (anchors ignored)."""
    bad = []
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor in the same page
        file_part = target.split("#", 1)[0]
        if not (path.parent / file_part).exists():
            bad.append(target)
    return bad


def tracked_results() -> list:
    out = subprocess.run(["git", "ls-files", "-z", "--", RESULTS], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_env_page_equals_env_module():
    read = env_variables_read(ENV_PY.read_text())
    documented = env_page_variables(ENV_PAGE.read_text())
    assert read, "found no COMMLIB_* variable in commlib/utils/env.py"
    missing, extra = sorted(read - documented), sorted(documented - read)
    assert not missing and not extra, (
        f"docs/environment.md's table and commlib/utils/env.py differ: not documented {missing}, "
        f"documented but not read {extra}")


def test_env_parser_ignores_docstrings_and_messages():
    source = ('"""COMMLIB_IN_DOCSTRING"""\n'
              'def f():\n    """COMMLIB_IN_FUNCTION_DOC"""\n    return _get("COMMLIB_READ", "x")\n'
              'def g(v):\n    raise ValueError(f"COMMLIB_READ={v!r}: bad")\n'
              'def h():\n    for n in ("COMMLIB_LOOPED", "LOCAL_WORLD_SIZE"):\n        pass\n')
    assert env_variables_read(source) == {"COMMLIB_READ", "COMMLIB_LOOPED"}


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: links to missing files: {broken_links(path)}"


def test_readme_length():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert 150 <= lines <= 220, f"README.md has {lines} lines; keep it between 150 and 220 (details go to docs/)"


def test_committed_results_are_named_and_cited():
    files = tracked_results()
    if not files:
        pytest.skip("not a git checkout, or no tracked results")
    docs = "\n".join(p.read_text() for p in doc_files())
    misnamed = [f for f in files if not RESULT_NAME.fullmatch(Path(f).name)]
    uncited = [f for f in files if Path(f).name not in docs]
    assert not misnamed, f"results not named <tool>_<gpu>x<n>_<yyyymmdd>_<commit>.<ext>: {misnamed}"
    assert not uncited, f"results no doc cites (list them in docs/results.md): {uncited}"


def test_result_name_pattern():
    ok = ["bench_intranode_H200x2_20261130_917fdc0.json", "overlap_network_i2048_s4_b_H200x2_20261201_4b28391.png",
          "gpu_check_H200x2_20261130_68918e8.log"]
    bad = ["bench_intranode_NVIDIA_H200_x2_20261130_143749.json", "overlap_NVIDIA_H200_v3.json",
           "tune_H200x2_2026113_f5cb9dd.json", "bench_H200x2_20261130_917fdc0.csv"]
    assert all(RESULT_NAME.fullmatch(n) for n in ok)
    assert not any(RESULT_NAME.fullmatch(n) for n in bad)

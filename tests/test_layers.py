"""The package's layering (docs/architecture.md): imports point down, no circle, no function-local
import of commlib's own modules, and benchmarks / experiments depend one way. Parsed, not imported."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lower number = lower layer. A module may import its own layer or lower ones; never a higher one.
LAYERS = [
    (0, ("commlib.version", "commlib.utils")),
    (1, ("commlib.config", "commlib.topology", "commlib.layout", "commlib.handle", "commlib.validate",
         "commlib.fp8", "commlib.routing")),
    (2, ("commlib.cuda",)),
    (3, ("commlib.tuning.search", "commlib.tuning.cache")),
    (4, ("commlib.backends",)),
    (5, ("commlib.buffer", "commlib.low_latency_mode")),
    (6, ("commlib.tuning.autotune", "commlib.tuning.__main__", "commlib.tuning", "commlib.elastic")),
    (7, ("commlib.training",)),
    (8, ("commlib.bench",)),
    # the package root, the DeepEP compatibility surface
    (9, ("commlib", "deep_ep")),
]


# The order inside a folder of one layer: a module imports only modules listed before it (or itself).
INSIDE = {
    "commlib.backends.internode": ["exchange", "geometry", "rows", "kernels", "fanout",   # engine-free
                                   "network", "node", "groups", "wiring",                  # the seams
                                   "counted", "padded", "kept", "device",                  # the data paths
                                   "twins", "engine"],
}


def layer_of(mod: str) -> int:
    best, best_len = None, -1
    for level, prefixes in LAYERS:
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and len(p) > best_len:
                best, best_len = level, len(p)
    assert best is not None, f"{mod} is in no layer: add it to LAYERS (tests/test_layers.py)"
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(top: str) -> dict:
    return {module_name(p): p for p in sorted((ROOT / top).rglob("*.py"))}


def imports_of(path: Path, mod: str, known: set) -> list:
    """(imported module, line, function-local?) for every import statement in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[:len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in child.names:
                    full = f"{base}.{a.name}"
                    out.append((full if full in known else base, child.lineno, local))
            visit(child, inner)

    visit(tree, False)
    return out


def graph(tops) -> dict:
    mods = {}
    for top in tops:
        mods.update(modules(top))
    known = set(mods)
    return {m: imports_of(p, m, known) for m, p in mods.items()}, mods


def own(name: str) -> bool:
    return name == "commlib" or name.startswith("commlib.") or name == "deep_ep" or name.startswith("deep_ep.")


def test_imports_point_down_and_are_module_level():
    edges, _ = graph(["commlib"] + (["deep_ep"] if (ROOT / "deep_ep").is_dir() else []))
    problems = []
    for mod, imps in edges.items():
        for target, line, local in imps:
            if not own(target) or target == mod:
                continue
            if local:
                problems.append(f"{mod}:{line} imports {target} inside a function (import it at module level)")
            if layer_of(target) > layer_of(mod):
                problems.append(f"{mod}:{line} imports {target}, a higher layer ({layer_of(target)} > {layer_of(mod)})")
    assert not problems, "\n".join(problems)


def inside_problems(edges: dict) -> list:
    """Imports that point up the order of INSIDE within a folder, and modules missing from it."""
    problems = []
    for folder, order in INSIDE.items():
        rank = {f"{folder}.{name}": i for i, name in enumerate(order)}
        for mod, imps in edges.items():
            if not mod.startswith(folder + "."):
                continue
            if mod not in rank:
                problems.append(f"{mod} is not in INSIDE[{folder!r}] (tests/test_layers.py)")
                continue
            for target, line, _ in imps:
                if target in rank and rank[target] > rank[mod]:
                    problems.append(f"{mod}:{line} imports {target}, later in {folder}'s order")
    return problems


def test_folders_keep_their_inner_order():
    edges, _ = graph(["commlib"])
    problems = inside_problems(edges)
    assert not problems, "\n".join(problems)


def find_cycle(edges: dict):
    state, stack = {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t, _, _ in edges.get(m, ()):
            if t not in edges or t == m:
                continue
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if state.get(t) is None:
                found = dfs(t)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in edges:
        if state.get(m) is None:
            found = dfs(m)
            if found:
                return found
    return None


def test_no_import_circle():
    edges, _ = graph(["commlib"])
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_benchmarks_and_experiments_depend_one_way():
    bad = []
    for top, forbidden in (("commlib", ("benchmarks", "experiments", "tests")), ("benchmarks", ("experiments", "tests"))):
        if not (ROOT / top).is_dir():
            continue
        edges, _ = graph([top])
        for mod, imps in edges.items():
            bad += [f"{mod}:{line} imports {t}" for t, line, _ in imps if t.split(".")[0] in forbidden]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("case", ["circle", "upward", "local", "inside"])
def test_checker_catches_planted_violations(case, tmp_path):
    """The checks above fail on the violations they exist for (planted in a synthetic graph)."""
    if case == "circle":
        assert find_cycle({"commlib.a": [("commlib.b", 1, False)], "commlib.b": [("commlib.a", 1, False)]})
    elif case == "upward":
        assert layer_of("commlib.buffer") > layer_of("commlib.backends.reference")
    elif case == "inside":
        planted = {"commlib.backends.internode.exchange": [("commlib.backends.internode.engine", 3, False)]}
        assert inside_problems(planted) == ["commlib.backends.internode.exchange:3 imports "
                                            "commlib.backends.internode.engine, later in commlib.backends.internode's order"]
    else:
        p = tmp_path / "m.py"
        p.write_text("def f():\n    from commlib import buffer\n")
        assert imports_of(p, "commlib.utils.m", {"commlib.buffer"}) == [("commlib.buffer", 2, True)]

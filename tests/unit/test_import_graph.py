"""The package's import graph (module-level and function-level imports, TYPE_CHECKING ones too): no circles, and
no import from a lower layer to a higher one (docs/layout.md's layers)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mega_async"

# lowest first; a module may import from its own layer or below (a package's modules share its layer)
LAYERS = [
    {"utils"},  # leaves: comm (rank-0 agreement's one home), events, lifeline, diskspace, safe_load
    {"api"},  # contracts: types, config, allocation, the SGLang release table
    {"algo", "data", "reward", "bridge"},
    {"rollout", "inference", "server"},  # the client and the server meet only over HTTP (test below)
    {"trainer", "checkpoint"},
    {"run", "bench"},
    {"launch"},
    {"cli"},  # the one loose module: the entry point
]


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (a `from pkg import mod` counts as pkg.mod)."""
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):  # a module's own parent package is not an edge
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def layer(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: not in any layer of this test (add it to LAYERS and docs/layout.md)")


def test_no_import_circles():
    g = graph()
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_import_from_a_higher_layer():
    g = graph()
    bad = [f"{m} -> {n}" for m, ns in g.items() if m != "mega_async" for n in ns
           if n != "mega_async" and layer(n) > layer(m)]
    assert not bad, "lower layer imports a higher one: " + ", ".join(sorted(bad))


def test_the_driver_does_no_math():
    """run/loop.py only calls: no algorithm, packing or batch code of its own (advantages and the DP split are
    the trainer's dispatch; the step stats are the head's)."""
    g = graph()
    assert not {n for n in g["mega_async.run.loop"] if n.startswith(("mega_async.algo", "mega_async.algo.packing"))}
    tree = ast.parse((PKG / "run" / "loop.py").read_text())
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for n in ast.walk(tree) if isinstance(n, ast.Call)}
    math = {"cat", "stack", "mean", "sum", "batch_with_advantages", "grpo_advantages", "redistribute_groups",
            "concat_padded", "broadcast_object_list", "all_reduce"}
    assert not called & math, sorted(called & math)


def test_the_tree_is_the_layer_diagram():
    """No module loose at the package root but the entry point: every other module lives in a layer's folder."""
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "cli.py"))
    assert not loose, f"modules loose at the package root: {loose} (move each into its layer's folder)"


def test_the_client_and_the_server_meet_only_over_http():
    g = graph()
    crossing = sorted(f"{m} -> {n}" for m, ns in g.items() for n in ns
                      if (m.startswith("mega_async.inference.client") and n.startswith("mega_async.server"))
                      or (m.startswith("mega_async.server") and n.startswith("mega_async.inference.client")))
    assert not crossing, crossing


def test_api_imports_nothing_heavy():
    """api/ is contracts: no torch, no package module above the leaves."""
    g = graph()
    bad = sorted(f"{m} -> {n}" for m, ns in g.items() if m.startswith("mega_async.api") for n in ns
                 if not n.startswith(("mega_async.api", "mega_async.utils")))
    assert not bad, bad
    for p in (PKG / "api").glob("*.py"):
        tree = ast.parse(p.read_text())
        heavy = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
            {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not heavy & {"torch", "megatron", "transformers", "numpy"}, (p.name, heavy)


def test_no_file_over_800_lines():
    long = sorted(f"{p.relative_to(ROOT)} ({n})" for p in PKG.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 800)
    assert not long, f"files over 800 lines: {long}"

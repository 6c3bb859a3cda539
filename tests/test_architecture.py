"""The import graph keeps the arrows of docs/architecture.md: no circle, leaves that stay leaves, arrows that point down.

Every module under deltaserve/ is parsed with ast (an import inside a function counts as much as one at the top)
and its imports of deltaserve resolved to modules. A "unit" is a top-level module (config, cli, plan, images) or
package (budget, text, engine, ...) directly under deltaserve/.

The rules, in docs/architecture.md's words:
  (a) no import circle: not between modules (a module and the __init__ of its own package aside: importing
      a submodule runs its package's __init__, and the __init__ re-exports it), and not between units;
  (b) text/ is a leaf: it imports nothing of ours but config;
  (c) config.py imports nothing of ours; budget/ imports config and weights/ only (weights/ reads the checkpoint
      headers and knows what a load holds, budget/ does the arithmetic on them; rule (a) keeps weights/ and all
      it imports from ever importing budget/ back, so everyone above weights/ may import budget/);
  (d) arrows point down deploy -> server -> engine -> (cache, models, text) -> kernels, never up; nothing imports
      server/ but deploy/ and cli, nothing imports deploy/ or the plan command but cli (so `plan` and `deploy`
      never import each other: both use budget/);
  (e) the server enters the engine through one door (engine/door.py): of engine/ it imports only SERVER_DOOR's
      modules and of each only the names SERVER_DOOR lists (never a scheduler, a pool, a lock), and of an Engine it
      touches only ENGINE_SURFACE (any `engine.x`, `state.engine.x`, `self.engine.x` in server/);
  (f) one shape for every API: an API adapter (ADAPTERS: the openai*, anthropic* and responses* modules of server/)
      imports no other adapter, and the shared modules every adapter stands on (SHARED_BY_APIS) import no adapter;
  (g) docstrings of engine/ and models/ state contracts: a measured timing (ms, us, tok/s, "measured on") lives in a
      bench/results record, not there;
  (h) the runner picks the execution path, models are their math: the model files (MODEL_MATH) import no native
      decode path (NATIVE_DECODE: kernels/decode_cpu.py, models/decode_stack_path.py); the runner asks the path.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltaserve"

# (c), (b): what a leaf may import of ours, by unit
LEAVES = {
    "config": set(),
    "text": {"config"},
    "budget": {"config", "weights"},
}
# (d): the arrows of docs/architecture.md; an import may point at its own tier or a lower one. Units not named here (budget, config,
# weights, images, stress, cli, plan) are bound by the other rules only.
TIERS = {"deploy": 4, "server": 3, "engine": 2, "cache": 1, "models": 1, "text": 1, "kernels": 0}
# (d): the only units that may import these
IMPORTED_ONLY_BY = {
    "server": {"deploy", "cli"},
    "deploy": {"cli"},
    "plan": {"cli"},
}
# (d): arrows that break a rule today, each with the file, the issue that removes it, and why it waits. Entries are
# (importing module, imported unit). None today.
ALLOWED: set[tuple[str, str]] = set()
# (e): the engine modules server/ may import, and the names it may import of each: the Engine (its class, for loading
# it, and EngineStats), the door's types (EngineInfo, Submission, Refused, prepare_images, MAX_CHOICES),
# SamplingParams, the streams and their outputs, and internal_error (the one wording of an internal error for clients)
SERVER_DOOR = {
    "deltaserve.engine.engine": {"Engine", "EngineStats"},
    "deltaserve.engine.door": {"EngineInfo", "Submission", "Refused", "prepare_images", "MAX_CHOICES"},
    "deltaserve.engine.request": {"SamplingParams", "RequestOutput", "RequestStream", "TokenLogprob"},
    "deltaserve.engine.errors": {"internal_error"},
}
# (f): each API's adapter modules under server/, by name prefix; an adapter imports none of another API's
ADAPTERS = {"openai": ("openai",), "anthropic": ("anthropic",), "responses": ("responses", "response_store")}
# (f): the shared generation code every adapter uses, which knows no API (server/ modules, without the package)
SHARED_BY_APIS = {"generation", "chat", "protocol", "state", "output_request"}
# (e): what server/ may touch of an Engine: its description, its tokenizer (text/'s Tokenizer: encode, decode, chat
# templates), the door, and the calls an operator's routes and the drain make
# (h): the model files, their math only, and what picks a decode step's native path instead of them
MODEL_MATH = ("deltaserve.models.llama", "deltaserve.models.hybrid", "deltaserve.models.qwen3_5",
              "deltaserve.models.qwen3_next")
NATIVE_DECODE = ("deltaserve.kernels.decode_cpu", "deltaserve.models.decode_stack_path")
ENGINE_SURFACE = {"info", "tokenizer", "submit_all", "abort", "stats", "flush_cache", "start", "shutdown"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The deltaserve modules `name` imports anywhere in its file (function bodies included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from deltaserve.x import y` imports the module x.y when there is one, else a name of x
            targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module: its module
                target = target.rpartition(".")[0]
            if target.startswith("deltaserve.") and target != name:
                found.add(target)
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _own_package(a: str, b: str) -> bool:
    """b is a package whose __init__ a lives under, or the other way round."""
    return a.startswith(b + ".") or b.startswith(a + ".")


def _arrows(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importing module, imported unit) for every import across units."""
    return sorted({(m, _unit(t)) for m, targets in graph.items() for t in targets if _unit(t) != _unit(m)})


def test_no_circle_between_modules():
    graph = _graph()
    edges = {m: {t for t in targets if not _own_package(m, t)} for m, targets in graph.items()}
    circles = _circles(edges)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_no_circle_between_units():
    edges = defaultdict(set)
    for module, unit in _arrows(_graph()):
        edges[_unit(module)].add(unit)
    circles = _circles(edges)
    assert not circles, "import circles between units: " + "; ".join(" <-> ".join(c) for c in circles)


def test_leaves_import_only_what_they_may():
    wrong = [f"{m} imports {u}" for m, u in _arrows(_graph())
             if _unit(m) in LEAVES and u not in LEAVES[_unit(m)] and (m, u) not in ALLOWED]
    assert not wrong, "\n".join(wrong)


def test_arrows_point_down():
    wrong = []
    for module, unit in _arrows(_graph()):
        if (module, unit) in ALLOWED:
            continue
        source = _unit(module)
        if source in TIERS and unit in TIERS and TIERS[unit] > TIERS[source]:
            wrong.append(f"{module} imports {unit}, which is above it")
        if unit in IMPORTED_ONLY_BY and source not in IMPORTED_ONLY_BY[unit]:
            wrong.append(f"{module} imports {unit}, which only {', '.join(sorted(IMPORTED_ONLY_BY[unit]))} may")
    assert not wrong, "\n".join(wrong)


def test_the_walk_sees_imports_inside_functions():
    """The graph is not vacuous: a function-level import (cli's lazy commands) is an arrow like any other."""
    arrows = _arrows(_graph())
    assert ("deltaserve.cli", "engine") in arrows
    assert len(_modules()) > 50


def test_server_enters_the_engine_by_its_door():
    wrong = [f"{m} imports {t}" for m, targets in _graph().items() if _unit(m) == "server"
             for t in targets if _unit(t) == "engine" and t not in SERVER_DOOR]
    assert not wrong, "server/ may import of engine/ only " + ", ".join(sorted(SERVER_DOOR)) + ":\n" + "\n".join(wrong)


def test_server_touches_only_the_engines_surface():
    wrong = []
    for path in sorted((PACKAGE / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            held = node.value  # `engine`, or `<anything>.engine`
            named_engine = (isinstance(held, ast.Name) and held.id == "engine") or \
                (isinstance(held, ast.Attribute) and held.attr == "engine")
            if named_engine and node.attr not in ENGINE_SURFACE:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses engine.{node.attr}")
    assert not wrong, "server/ reads an Engine through " + ", ".join(sorted(ENGINE_SURFACE)) + " only:\n" + \
        "\n".join(wrong)


def test_the_surface_rule_sees_engine_uses():
    """The surface rule is not vacuous: the server does touch engines, through names it can see."""
    touched = {node.attr for path in (PACKAGE / "server").rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Attribute)
               and isinstance(node.value, ast.Name) and node.value.id == "engine"}
    assert {"info", "submit_all", "tokenizer"} <= touched


def test_server_imports_only_the_doors_names():
    """(e) by name: `from deltaserve.engine.x import y` in server/ names only what SERVER_DOOR lists for x, and
    engine modules are not imported whole (`import deltaserve.engine.x` would reach anything in them)."""
    wrong = []
    for path in sorted((PACKAGE / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                wrong += [f"{where} imports {a.name} whole" for a in node.names
                          if a.name.startswith("deltaserve.engine")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deltaserve.engine"):
                allowed = SERVER_DOOR.get(node.module, set())
                wrong += [f"{where} imports {a.name} from {node.module}" for a in node.names if a.name not in allowed]
    assert not wrong, "server/ imports of engine/ only: " + \
        "; ".join(f"{m}: {', '.join(sorted(n))}" for m, n in SERVER_DOOR.items()) + "\n" + "\n".join(wrong)


def _api_of(module: str) -> str | None:
    """The API whose adapter a server/ module is, or None (shared, or the app's own)."""
    if _unit(module) != "server":
        return None
    name = module.removeprefix("deltaserve.server.")
    return next((api for api, prefixes in ADAPTERS.items() if name.startswith(prefixes)), None)


def test_api_adapters_import_no_other_adapter():
    wrong = [f"{m} ({_api_of(m)}) imports {t} ({_api_of(t)})" for m, targets in _graph().items() if _api_of(m)
             for t in targets if _api_of(t) not in (None, _api_of(m))]
    assert not wrong, "an API's adapter imports only its own modules and the shared ones:\n" + "\n".join(wrong)


def test_shared_generation_code_imports_no_api():
    graph = _graph()
    wrong = [f"server.{name} imports {t}" for name in sorted(SHARED_BY_APIS)
             for t in graph[f"deltaserve.server.{name}"] if _api_of(t)]
    assert not wrong, "the shared modules (" + ", ".join(sorted(SHARED_BY_APIS)) + ") know no API:\n" + \
        "\n".join(wrong)


def test_the_adapter_rules_see_every_api():
    """The adapter rules are not vacuous: each API has its modules, and each stands on the shared generation code."""
    graph = _graph()
    for api in ADAPTERS:
        modules = [m for m in graph if _api_of(m) == api]
        assert len(modules) >= 3, (api, modules)
        assert any("deltaserve.server.generation" in graph[m] for m in modules), api
    assert all(f"deltaserve.server.{name}" in graph for name in SHARED_BY_APIS)


# (g): docstrings under these units state contracts; measured timings live in bench/results and docs/benchmarks.md
CONTRACT_UNITS = ("engine", "models")
TIMING = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|us|µs|ns|tok/s|GB/s|MB/s)\b|~\d[\d.]*\s?s\b|\bmeasured on\b",
                    re.IGNORECASE)


def _timings_in_docstrings(path: Path) -> list[str]:
    """`file:line: text` for each measured timing in the module's, its classes' and its functions' docstrings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False) or ""
            found += [f"{path}:{getattr(node, 'lineno', 1)}: {m.group(0)!r}" for m in TIMING.finditer(doc)]
    return found


def test_engine_and_model_docstrings_state_contracts_not_timings():
    found = [hit for unit in CONTRACT_UNITS for path in sorted((PACKAGE / unit).rglob("*.py"))
             for hit in _timings_in_docstrings(path)]
    assert not found, ("a measured timing in a docstring of " + ", ".join(CONTRACT_UNITS) + "/ (move it to a "
                       "bench/results lab-notes record, then python bench/results.py):\n" + "\n".join(found))


def test_the_timing_rule_sees_timings(tmp_path):
    """The timing rule is not vacuous: the forms the docstrings used before are found, a shape or a count is not."""
    module = tmp_path / "planted.py"
    module.write_text('"""A step is ~7.5 ms on 2 cores."""\n\n\ndef f():\n    """At 2.9x (145.7 against 50.8 tok/s); '
                      'a pass ~155 us; built on first use (~0.5 s); Measured on Zen 4."""\n\n\n'
                      'def g():\n    """[T, 1, rd] rows, 16 requests, 2 MB pages, 1 + k rows."""\n')
    assert len(_timings_in_docstrings(module)) == 5


def _native_decode_imports(graph: dict[str, set[str]], modules) -> list[str]:
    """`module imports target` for each of `modules` that imports a native decode path module (rule h)."""
    return [f"{m} imports {t}" for m in modules for t in sorted(graph.get(m, ())) if t in NATIVE_DECODE]


def test_models_are_their_math_and_the_runner_picks_the_path():
    graph = _graph()
    assert all(m in graph for m in MODEL_MATH)
    wrong = _native_decode_imports(graph, MODEL_MATH)
    assert not wrong, ("a model file picks its own execution path; the runner asks models/decode_stack_path.py "
                       "(docs/architecture.md):\n" + "\n".join(wrong))
    assert "deltaserve.models.decode_stack_path" in graph["deltaserve.engine.runner"]


def test_the_path_rule_sees_the_imports():
    """The path rule is not vacuous: the path module itself imports decode_cpu, and the rule says so of it."""
    graph = _graph()
    assert _native_decode_imports(graph, ["deltaserve.models.decode_stack_path"]) == [
        "deltaserve.models.decode_stack_path imports deltaserve.kernels.decode_cpu"]

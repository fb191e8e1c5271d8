"""The package's import structure, read from the source with `ast` (nothing is imported): no import
cycle, and no module importing from a higher layer. Module-level and function-level imports count
alike (a lazy import is still a dependency). The suites in `experiments/` (top of the repository) are
covered too: they sit above the library (layer 6.5, under the CLI), so no library module imports them
(the library reaches them through the `smelt_jax.design.suites` registry) and they import no entry point."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "smelt_jax"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
SUITES = "experiments"  # the suites package, beside the library; its modules keep their full names
SUITES_ROOT = ROOT.parent / SUITES

# Layers, low to high: a module may import its own layer and lower ones. Keys are module paths under
# smelt_jax ("" is the package itself); the longest matching key decides. Every top-level module and
# package must be listed: a new one fails `test_every_module_has_a_layer` until it is added here.
LAYERS: dict[str, int] = {
    # 0 - foundations: configuration, facts, naming, files; no model code, no training.
    "": 0,
    "design": 0,  # the experiment design (config, budgets, matcher, descriptors, suites registry)
    "run_files": 0,  # run folders and their files
    "platform": 0,  # platform plumbing (hardware, storage, errors, exit codes, progress)
    "design.config": 0,
    "platform.errors": 0,  # the user-error family (SmeltError)
    "kernels.backend": 0,  # backend names and the one backend decision (the config validates with it)
    "design.budget": 0,
    "platform.hardware": 0,
    "platform.paths": 0,
    "platform.jax_platform": 0,
    "platform.fit_isa": 0,  # the CPU kernels a fit process is pinned to (the same bits on every x86 CPU)
    "parallel.sharding": 0,
    "design.descriptors": 0,
    "design.matching": 0,
    "run_files.overrides": 0,  # --override key=value on a RunSpec
    "run_files.rundir": 0,  # paths only
    "run_files.path_names": 0,
    "run_files.memory_estimate": 0,  # a run's memory per device, estimated before anything is written
    "run_files.run_spec_file": 0,  # run.json read through one function (damaged or edited: one line)
    "platform.storage": 0,  # the one storage module: local paths and gs://
    "run_files.checkpoint_format": 0,  # the checkpoint format on disk (no JAX)
    "design.suites": 0,  # the registry through which the library reaches experiments/
    "run_files.run_lookup": 0,  # a run by id: the suites, then the runs folder (config-file and override runs)
    "run_files.run_data": 0,  # the data a run trains on: its record and the check (no JAX)
    "platform.exit_codes": 0,  # process exit codes (42: preempted, restart me)
    "run_files.results": 0,
    "data": 0,
    "platform.progress": 0,  # tqdm on a terminal, plain lines elsewhere (trainer, local sweep)
    # 1 - compute kernels.
    "kernels": 1,
    # 2 - the model.
    "model": 2,
    # 3 - training.
    "train": 3,
    # 4 - running over meshes, compiling ahead of time.
    "parallel": 4,
    "compile": 4,
    # 5 - what is done with runs: analysis, laws, published numbers, sweeps.
    "analysis": 5,
    "scaling": 5,
    "design.paper": 5,
    "design.pairs": 5,  # a matched pair compared (budgets, mismatches, Appendix A)
    "sweep": 5,
    # 6 - end-to-end jobs.
    "demo": 6,
    # 6.5 - the suites (experiments/, outside the package): built from the library, read by it only
    # through the smelt_jax.design.suites registry; the CLI imports them (and so fills the registry).
    SUITES: 6.5,
    # 7 - entry points.
    "cli": 7,
    "analysis.notebooks_runner": 7,
    "__main__": 7,
}


def _modules() -> dict[str, Path]:
    """Dotted name (without the package prefix; "" for the package; `experiments.*` in full) -> source
    file."""
    found = {}
    for root, prefix in ((ROOT, []), (SUITES_ROOT, [SUITES])):
        for path in sorted(root.rglob("*.py")):
            parts = prefix + list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module a dotted name (relative to the package) lives in: itself or its longest known prefix."""
    while name not in MODULES:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return name


def _relative(absolute: str) -> str | None:
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1:]
    if absolute == SUITES or absolute.startswith(SUITES + "."):
        return absolute
    return None


def _imports(module: str, path: Path) -> set[str]:
    """The package modules that `module` imports anywhere in its source (relative imports resolved;
    `from a import b` counts as importing a.b when b is a module, else a)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    suites = module == SUITES or module.startswith(SUITES + ".")
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [_relative(alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                absolute = ".".join(([] if suites else [PACKAGE]) + base
                                    + ([node.module] if node.module else []))
            else:
                absolute = node.module or ""
            base_name = _relative(absolute)
            if base_name is None:
                continue
            names = [".".join(filter(None, (base_name, alias.name))) for alias in node.names]
            names = [n if n in MODULES else base_name for n in names]
        else:
            continue
        targets.update(owner for owner in map(_owner_or_none, names) if owner is not None)
    targets.discard(module)
    return targets


def _owner_or_none(name: str | None) -> str | None:
    return None if name is None else _owner(name)


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> int | None:
    """The layer of `module` or of its nearest listed parent package; None when neither is listed (the
    package itself, "", is listed on its own and is nobody's fallback)."""
    key = module
    while key:
        if key in LAYERS:
            return LAYERS[key]
        key = key.rpartition(".")[0]
    return LAYERS[""] if module == "" else None


def _show(module: str) -> str:
    if module == SUITES or module.startswith(SUITES + "."):
        return module
    return f"{PACKAGE}.{module}" if module else PACKAGE


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None. Iterative depth-first search."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_graph_is_read_from_the_source():
    assert {"design.config", "model.moe", "kernels.experts"} <= set(MODULES)
    assert "kernels.experts" in GRAPH["model.expert_compute"]  # a module-level import
    assert "kernels.pallas_ffn" in GRAPH["kernels.experts"]  # a function-level import
    assert {"experiments", "experiments.smelt16", "experiments.placement"} <= set(MODULES)
    assert "design.descriptors" in GRAPH["experiments"]  # the suites import the library
    assert "experiments" in GRAPH["cli.experiments"]  # the CLI imports the suites (filling the registry)


def test_no_library_module_imports_the_suites():
    """The library reads suites through `smelt_jax.design.suites`; only entry points import `experiments`."""
    found = sorted(f"{_show(m)} imports {_show(t)}" for m, targets in GRAPH.items() for t in targets
                   if (t == SUITES or t.startswith(SUITES + ".")) and _layer(m) < LAYERS[SUITES])
    assert not found, "library modules importing experiments/:\n" + "\n".join(found)


def test_a_library_import_of_the_suites_would_be_caught(tmp_path):
    source = tmp_path / "graph.py"
    source.write_text("def f():\n    import experiments\n    from experiments.placement import x\n")
    assert _imports("sweep.graph", source) == {"experiments", "experiments.placement"}


def test_no_import_cycle():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(map(_show, cycle))


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycle = _find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_has_a_layer():
    missing = sorted(_show(m) for m in MODULES if _layer(m) is None)
    assert not missing, (f"modules without a layer: {missing}; add their top-level name to LAYERS in "
                         "tests/test_imports.py")


def test_no_module_imports_from_a_higher_layer():
    upward = sorted(f"{_show(m)} (layer {_layer(m)}) imports {_show(t)} (layer {_layer(t)})"
                    for m, targets in GRAPH.items() for t in targets
                    if _layer(m) is not None and _layer(t) is not None and _layer(t) > _layer(m))
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)

"""The shape of the code (issue 12), checked from the source with `ast`, without importing it: modules of one
idea (at most MAX_LINES lines), no import cycles, and the import contracts between the layers.

Every import statement counts, wherever it is: at module level, inside a function (the runtime imports
lazily to keep start-up fast) or under TYPE_CHECKING. An import names the deepest module of the project it
reaches: `from pipeflow import checkpoint` is pipeflow.checkpoint, `from pipeflow.engine import Engine`
is pipeflow.engine. Imports that go through importlib with a string (the compatibility names of
failure.py and checkpoint.py, the model builders of spec.py) are not seen: they are never made at import time.
"""
from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pipeflow", "partitioner", "launch")
MAX_LINES = 300

# Modules allowed over MAX_LINES for now. Shrink this list; never grow it.
OVERSIZE = {
}

# Schedule and file formats: the schedule IR and the plan, profile and JSON-file modules. They import
# nothing of the runtime, of the planner or of torch: pipeflow-plan and the launcher read them without it.
FORMATS = {"pipeflow.schedule", "pipeflow.actions", "pipeflow.kinds", "pipeflow.zerobubble", "pipeflow.interleave",
           "pipeflow.warmup", "partitioner.plan",
           "partitioner.profile", "partitioner.jsonfile", "partitioner.ties"}
# What of pipeflow the partitioner may import (directly or through another module): the schedule IR
# (actions, the schedule kind table, the generators), which the simulator replays; and for the profiler
# alone, the model contract it profiles (pipeflow.spec: ModelSpec, build_model) and the data order it
# feeds (pipeflow.data.loader: MicrobatchLoader), and the B/W split it times (pipeflow.split).
# pipeflow.hostmem: the CPU ranks' malloc setting (ctypes only), which measurement takes on to time as a rank runs;
# pipeflow.tensorops: an update's non-finite check and weight copy (torch only), which measurement times.
PARTITIONER_MAY_IMPORT = {"pipeflow.schedule", "pipeflow.actions", "pipeflow.kinds", "pipeflow.zerobubble",
                         "pipeflow.interleave", "pipeflow.warmup", "pipeflow.hostmem", "pipeflow.tensorops"}
PROFILER_MAY_IMPORT = PARTITIONER_MAY_IMPORT | {"pipeflow.spec", "pipeflow.data.loader", "pipeflow.split",
                                                "pipeflow.received", "pipeflow.structure",  # data as a stage has it
                                                "pipeflow.failure",  # structure's refusal is a usage error
                                                "pipeflow.graphcheck",  # timed as the stages will run (graphs)
                                                "pipeflow.seeds"}  # the loader seeds a microbatch's sample reads
PROFILER_MODULES = {"partitioner.profiler", "partitioner.layermem", "partitioner.chain", "partitioner.layertime",
                    "partitioner.companion"}  # they run the layers
# The communication modules, the only ones that may import mpi4py or torch.distributed: pipeflow.comm (the
# point-to-point channels and process groups of torch.distributed, and MPI's bootstrap of them) and
# pipeflow.control (the control channel on MPI's COMM_WORLD: agreement, polled messages, the thread level).
COMM = {"pipeflow.comm", "pipeflow.control"}
# Modules that still call MPI or torch.distributed themselves (issue 12 moved them all behind the two
# above). Keep it empty: a module that starts importing either fails this test.
COMM_EXCEPTIONS: dict[str, str] = {}
COMM_LIBRARIES = ("mpi4py", "torch.distributed")


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in source_files()}


def imported_names(path: Path) -> set[str]:
    """The dotted name of everything an import statement of `path` imports: `import a.b` gives a.b,
    `from a.b import c` gives a.b.c (a module or a name in one: project_imports tells them apart)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x, from .a import b
                parts = package.split(".")
                anchor = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


@cache
def project_imports(name: str) -> frozenset[str]:
    """The project modules that `name` imports directly: for each import, the longest module its name starts with."""
    mods = modules()
    out = set()
    for dotted in imported_names(mods[name]):
        parts = dotted.split(".")
        found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in mods), None)
        if found is not None and found != name:
            out.add(found)
    return frozenset(out)


def closure(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for m in project_imports(todo.pop()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen - {name}


def test_the_scan_sees_imports_inside_functions_and_from_package_imports():
    # Guards against a scan that finds nothing and passes everything.
    assert "pipeflow.stash" in project_imports("pipeflow.engine")        # inside Engine.__init__
    assert "pipeflow.checkpoint" in project_imports("pipeflow.supervisor")  # from pipeflow import checkpoint
    assert "partitioner.service" in project_imports("partitioner.timeline")  # under TYPE_CHECKING
    assert "pipeflow.engine" in closure("pipeflow.runner")
    assert "mpi4py.MPI" in imported_names(modules()["pipeflow.comm"])


def test_no_module_is_over_the_size_limit():
    over = {}
    for path in source_files():
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in OVERSIZE:
            over[rel] = n
    assert not over, (f"modules over {MAX_LINES} lines: {over}; split them by idea (issue 12) rather than "
                      "adding them to OVERSIZE")
    fits = [rel for rel in OVERSIZE if len((ROOT / rel).read_text().splitlines()) <= MAX_LINES]
    assert not fits, f"{fits} now fit in {MAX_LINES} lines: remove them from OVERSIZE"


def test_no_import_cycles():
    """Tarjan's strongly connected components of the import graph: every one must be a single module."""
    graph = {m: sorted(project_imports(m)) for m in modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, f"import cycles: {cycles}"


def test_formats_import_nothing_of_the_runtime():
    for name in sorted(FORMATS):
        reached = closure(name)
        assert reached <= FORMATS, f"{name} imports {sorted(reached - FORMATS)}: formats stay free of the runtime"
        heavy = {n for n in imported_names(modules()[name]) if n.split(".")[0] in ("torch", "mpi4py", "numpy")}
        assert not heavy, f"{name} imports {sorted(heavy)}"


def test_the_partitioner_does_not_import_the_runtime():
    for name in sorted(m for m in modules() if m.startswith("partitioner.") or m == "partitioner"):
        allowed = PROFILER_MAY_IMPORT if name in PROFILER_MODULES else PARTITIONER_MAY_IMPORT
        runtime = {m for m in closure(name) if m.split(".")[0] == "pipeflow"} - allowed
        assert not runtime, f"{name} imports {sorted(runtime)} of pipeflow; allowed: {sorted(allowed)}"


def uses_comm_library(path: Path) -> set[str]:
    """The communication libraries `path` imports, or reaches as torch.distributed through `import torch`."""
    found = {lib for n in imported_names(path) for lib in COMM_LIBRARIES if n == lib or n.startswith(lib + ".")}
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name)
                and node.value.id == "torch"):
            found.add("torch.distributed")
    return found


def test_only_the_communication_module_imports_mpi_or_torch_distributed():
    users = {m: uses_comm_library(p) for m, p in modules().items()}
    users = {m: libs for m, libs in users.items() if libs}
    assert COMM <= set(users), f"the scan finds no use in {sorted(COMM - set(users))}: it is broken"
    new = {m: sorted(libs) for m, libs in users.items() if m not in COMM and m not in COMM_EXCEPTIONS}
    assert not new, f"{new} use MPI or torch.distributed directly: go through pipeflow/comm.py or pipeflow/control.py"
    gone = sorted(m for m in COMM_EXCEPTIONS if m not in users)
    assert not gone, f"{gone} no longer use MPI or torch.distributed: remove them from COMM_EXCEPTIONS"

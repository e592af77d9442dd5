"""The rooms' layering, read from the import graph (extproc/__init__.py lists the rooms).

Every module of the product (`extproc`) and of the simulator (`prefix_epp_sim`) belongs to one
room; `LAYERS` orders the rooms, lowest first. A module may import its own room and any room of a
lower layer; rooms of one layer never import each other. Imports inside functions count too: a
lazy import couples two rooms as much as a top-level one. Tests and benchmarks share one home for
their support code (`testkit`): nothing imports from `tests`, and the product never imports tests,
benchmarks or the support code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("pb",),
    ("config",),
    ("core",),
    ("request", "prefix"),
    ("tokenization", "kvevents", "discovery", "scraping"),
    ("sync", "scheduling"),
    ("flowcontrol",),
    ("control",),
    ("telemetry",),
    ("transport",),
    ("runtime", "simulator", "sidecar"),
    ("commands",),
)
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
PRODUCT = ("extproc", "prefix_epp_sim")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str | None:
    """The room of a product module; None for the package itself (`extproc`, `extproc.__main__`)."""
    parts = module.split(".")
    if parts[0] == "prefix_epp_sim":
        return "simulator"
    if parts[0] != "extproc" or len(parts) < 2:
        return None
    return "commands" if parts[1] == "__main__" else parts[1]


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import statement, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}" if base else alias.name


def python_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_room_has_a_layer() -> None:
    rooms = {room for p in python_files(*PRODUCT) if (room := room_of(module_name(p))) is not None}
    assert rooms <= set(LAYER), f"rooms without a layer (add them to LAYERS): {sorted(rooms - set(LAYER))}"
    assert set(LAYER) <= rooms, f"layers name rooms that do not exist: {sorted(set(LAYER) - rooms)}"


def test_no_room_imports_a_higher_one_or_a_peer() -> None:
    bad = []
    for path in python_files(*PRODUCT):
        here = room_of(module_name(path))
        for line, target in imports(path):
            there = room_of(target)
            if here is None or there is None or there == here:
                continue
            if LAYER[there] >= LAYER[here]:
                kind = "a peer" if LAYER[there] == LAYER[here] else "a higher room"
                bad.append(f"{path.relative_to(REPO)}:{line}: {here} imports {kind}, {there} ({target})")
    assert not bad, "\n".join(bad)


def test_the_product_imports_no_tests_benchmarks_or_support_code() -> None:
    bad = [f"{p.relative_to(REPO)}:{line}: {target}" for p in python_files(*PRODUCT)
           for line, target in imports(p) if target.split(".")[0] in ("tests", "bench", "testkit")]
    assert not bad, "\n".join(bad)


def test_support_code_has_one_home() -> None:
    """Support code lives in `testkit`: no module imports anything from `tests` (a test module, a
    conftest, or a helper kept beside the tests)."""
    bad = [f"{p.relative_to(REPO)}:{line}: {target}" for p in python_files("tests", "bench", "testkit")
           for line, target in imports(p) if target.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)

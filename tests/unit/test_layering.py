"""The packages import in one direction, and every module reads in one sitting.

    storage_client ← attestation ← trainer ← settlement ← audit ← cli ;  proto under trainer

Inside ``trainer/`` the wings import in one direction too (TRAINER_WINGS below): the codec and the
network edge at the bottom, the model, data and round maths above them, a run's storage above the
round maths, and the coordinator and the worker on top, neither importing the other.

``trainer/`` (the code a worker runs and attests to, with the coordinator's state machine) imports
nothing from ``settlement/``, ``audit/``, ``cli/`` or ``benchmarks/``; nothing outside ``cli/`` and
the tests imports ``benchmarks/``, and ``cli/`` only inside the subcommand that runs it. No class is
over 300 lines and no function over 80 outside the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("storage_client", "attestation", "proto", "trainer", "settlement", "audit", "cli", "benchmarks")
# What each package may import at module level (besides itself).
ALLOWED: dict[str, set[str]] = {
    "storage_client": set(),
    "proto": set(),
    "attestation": {"storage_client"},
    "trainer": {"storage_client", "attestation", "proto"},
    "settlement": {"storage_client", "attestation", "proto", "trainer"},
    "audit": {"storage_client", "attestation", "proto", "trainer", "settlement"},
    "cli": {"storage_client", "attestation", "proto", "trainer", "settlement", "audit"},
    "benchmarks": set(PACKAGES),
}
# Imported inside a function only (the subcommand that runs it), never at module level.
LAZY_ONLY = {"cli": {"benchmarks"}}


def modules() -> list[tuple[str, Path, ast.Module]]:
    out = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            out.append((package, path, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module.split(".")[0]]
    return []


def module_level(tree: ast.Module) -> set[int]:
    """The import statements that run when the module is imported (not inside a function)."""
    out: set[int] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.add(id(node))
        stack.extend(ast.iter_child_nodes(node))
    return out


def test_packages_import_in_one_direction() -> None:
    wrong = []
    for package, path, tree in modules():
        eager = module_level(tree)
        for node in ast.walk(tree):
            for name in imported(node):
                if name not in PACKAGES or name == package:
                    continue
                lazy_only = name in LAZY_ONLY.get(package, set())
                if name not in ALLOWED[package] and not lazy_only:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
                elif lazy_only and id(node) in eager:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name} at module level")
    assert not wrong, "\n".join(wrong)


def test_trainer_imports_nothing_from_settlement() -> None:
    for package, path, tree in modules():
        if package == "trainer":
            assert not [n for n in ast.walk(tree) if "settlement" in imported(n)], path


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    long = []
    for _, path, tree in modules():
        for node in ast.walk(tree):
            limit = 300 if isinstance(node, ast.ClassDef) else 80
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines (limit {limit})")
    assert not long, "\n".join(long)


# What each part of trainer/ may import from the others (besides itself), eagerly or lazily. The
# shared modules at trainer/'s top: config and config_fields (the run's configuration), progress.
SHARED = {"config", "config_fields", "progress"}
TRAINER_WINGS: dict[str, set[str]] = {
    "net": set(),
    "codec": {"config_fields"},
    "config": {"codec", "config_fields"},
    "config_fields": set(),
    "progress": set(),
    "model": {"codec"} | SHARED,
    "data": SHARED,
    "rounds": {"codec"} | SHARED,
    "runstore": {"codec", "model", "rounds"} | SHARED,
    "runtime": {"codec", "model", "data", "rounds"} | SHARED,
    "coordinator": {"net", "codec", "model", "data", "rounds", "runstore", "runtime"} | SHARED,
    "worker": {"net", "codec", "model", "data", "rounds", "runstore", "runtime"} | SHARED,
}


def test_trainer_wings_import_in_one_direction() -> None:
    wrong = []
    for package, path, tree in modules():
        if package != "trainer" or path.parent == REPO / "trainer" and path.name == "__init__.py":
            continue
        part = path.relative_to(REPO / "trainer").parts[0].removesuffix(".py")
        assert part in TRAINER_WINGS, f"{path.relative_to(REPO)}: a part of trainer/ that TRAINER_WINGS does not place"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("trainer."):
                other = node.module.split(".")[1]
                if other != part and other not in TRAINER_WINGS[part]:
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} ({part}) imports trainer.{other}")
    assert not wrong, "\n".join(wrong)

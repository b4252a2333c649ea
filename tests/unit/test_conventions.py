"""Project conventions that are easy to break silently."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inferq", "api", "worker", "scheduler", "kernels")
# user-facing command output is allowed to print; everything else logs through structlog
CLI_MODULES = {"inferq/cli.py", "inferq/up.py", "worker/cli.py", "worker/service_cli.py", "api/cli.py"}


def _sources():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


def test_no_print_outside_cli():
    offenders = []
    for rel, tree in _sources():
        if rel in CLI_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"use structlog, not print: {offenders}"


def test_only_settings_reads_the_environment():
    offenders = []
    allowed = {"inferq/settings.py", "inferq/up.py"}  # up.py only passes the environment on to its children
    for rel, tree in _sources():
        if rel in allowed:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                # writing a child's environment is fine; reading settings from it is not
                parent_src = ast.get_source_segment((ROOT / rel).read_text(), node) or ""
                offenders.append(f"{rel}:{node.lineno}:{parent_src}")
    assert not offenders, f"read configuration through inferq.settings: {offenders}"


def test_scheduler_is_pure_python():
    for rel, tree in _sources():
        if not rel.startswith("scheduler/"):
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"torch", "numpy", "triton"}, f"{rel} imports {name}"

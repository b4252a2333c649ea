"""Project conventions that are easy to break silently."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inferq", "api", "worker", "scheduler", "kernels", "deploy")
# user-facing command output is allowed to print; everything else logs through structlog
CLI_MODULES = {"deploy/cli.py", "deploy/launcher.py", "worker/cli.py", "worker/service_cli.py", "api/cli.py"}


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
    allowed = {"inferq/settings.py", "deploy/launcher.py"}  # the launcher only passes the environment on to its children
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


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a module, at any depth (lazy imports count too), and of
    ``importlib.import_module("...")`` calls with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def _violations(package: str, forbidden, allowed=lambda rel, name: False) -> list[str]:
    out = []
    for rel, tree in _sources():
        if not rel.startswith(package + "/"):
            continue
        for line, name in _imports(tree):
            if name.split(".")[0] in forbidden and not allowed(rel, name):
                out.append(f"{rel}:{line} imports {name}")
    return out


def test_layering_of_the_packages():
    """Imports point down the stack: deploy (the command, the launcher) -> api / worker -> kernels, scheduler
    -> the shared core inferq/. The shared core imports none of the others (the job contract may name the
    scheduler's request types), the API process never loads torch or the model code, and the scheduler stays
    free of the rest (it may log through inferq.log)."""
    offenders = _violations("inferq", {"api", "worker", "kernels", "scheduler", "deploy", "bench"},
                            lambda rel, name: rel == "inferq/contract.py" and name == "scheduler.request")
    offenders += _violations("api", {"torch", "worker", "kernels"})
    offenders += _violations("scheduler", {"inferq", "api", "worker", "kernels", "deploy", "bench", "migrations"},
                             lambda rel, name: name == "inferq.log")
    assert not offenders, f"imports against the layering: {offenders}"


PRODUCT_PACKAGES = ["api", "worker", "scheduler", "kernels", "inferq", "deploy", "migrations"]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 60


def _says_why_long(lines: list[str], node: ast.AST) -> bool:
    """A long function passes when a comment starting "Long" sits just above it (above its decorators) or
    opens its body: the reader is told why it is not split."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    near = lines[max(0, first - 4):first - 1] + lines[node.body[0].lineno - 1 - 2:node.body[0].lineno]
    return any(line.strip().startswith("# Long") for line in near)


def test_modules_and_functions_stay_small():
    """Issue 13's size rule, kept: no product module over ~500 lines, no function over ~60 unless a comment
    says why (Triton JIT bodies cannot call Python helpers; an autogenerated first migration)."""
    too_big = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            lines = text.splitlines()
            if len(lines) > MAX_MODULE_LINES:
                too_big.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    length = node.end_lineno - node.lineno + 1
                    if length > MAX_FUNCTION_LINES and not _says_why_long(lines, node):
                        too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_big, "split these, or say why in a '# Long ...' comment:\n" + "\n".join(too_big)

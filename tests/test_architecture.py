"""The package's layering: no import circles, and no module above `specexec.backends` naming a runtime."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import specexec

PACKAGE = Path(specexec.__file__).parent
# Where a runtime may be named: the runtimes themselves, the command line's --backend choices, and the
# plain llama.cpp peer of the benchmark (a method, not our backend).
MAY_NAME_RUNTIMES = ("backends/", "cli_args.py", "cli.py", "bench/llamacpp.py", "bench/cli.py")


def module_name(path: Path) -> str:
    parts = ["specexec", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str], type_only: bool = False) -> set[str]:
    """The specexec modules `path` imports anywhere in it (at the top or inside a function), leaving out
    imports for type annotations only (under `if TYPE_CHECKING:`, which never run) unless `type_only`.
    The package imports absolutely only, so a relative import fails here."""
    found = set()
    tree = ast.parse(path.read_text())
    for block in ast.walk(tree):
        if not type_only and isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING":
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports_of(p, modules, type_only) - {module_name(p)} for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    assert "specexec.backends.base" in graph["specexec.engine"] | graph["specexec.drafters.base"]
    assert circles(graph) == []


def test_no_circle_even_among_type_only_imports() -> None:
    """A type two modules share lives where both can import it: a reader follows imports one way."""
    graph = import_graph(type_only=True)
    assert "specexec.backends.llamacpp.stream" in graph["specexec.backends.llamacpp.runner"]  # type-only
    assert circles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_only_the_backends_and_the_command_line_name_a_runtime() -> None:
    naming = re.compile(r"""["']llamacpp["']|backend\s*==""")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if not str(path.relative_to(PACKAGE)).startswith(MAY_NAME_RUNTIMES)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if naming.search(line)
    ]
    assert offenders == []


def test_only_the_llamacpp_backend_imports_the_streaming_package() -> None:
    """Streaming a GGUF from disk is the llama.cpp backend's own: the rest (the benchmark's llama.cpp
    peers included) loads a streamed model through `specexec.backends.llamacpp.weights`."""
    streaming = "specexec.backends.llamacpp.stream"
    graph = import_graph()
    assert any(name.startswith(streaming + ".") for name in graph), "the streaming package moved"
    offenders = sorted(
        module
        for module, imported in graph.items()
        if not module.startswith("specexec.backends.llamacpp")
        and any(name == streaming or name.startswith(streaming + ".") for name in imported)
    )
    assert offenders == []


MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def too_long(path: Path) -> list[str]:
    """What in the module at `path` passes the limits: the file's lines, each function's lines."""
    text = path.read_text()
    found = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        found.append(f"{path.name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.name}: {node.name} {lines} lines")
    return found


def test_no_file_over_600_lines_and_no_function_over_80() -> None:
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in too_long(path)]
    assert not found, found


def test_the_length_check_finds_long_files_and_functions(tmp_path: Path) -> None:
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES))
    long_function = tmp_path / "long.py"
    long_function.write_text(f"def long():\n{body}\n")
    assert too_long(long_function) == [f"long.py: long {MAX_FUNCTION_LINES + 1} lines"]
    long_file = tmp_path / "many.py"
    long_file.write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    assert too_long(long_file) == [f"many.py: {MAX_FILE_LINES + 1} lines"]

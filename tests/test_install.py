"""The README's two commands, CI's command, and the build fix they hand llama-cpp-python
(src/specexec/backends/llamacpp/llama_cpp_amx.cmake), tried on a small CMake project shaped like ggml's."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "src" / "specexec" / "backends" / "llamacpp" / "llama_cpp_amx.cmake"
INSTALL = ROOT / "install.sh"
BUILD_ARGS = (
    'export CMAKE_ARGS="-DGGML_RPC=ON '
    '-DCMAKE_PROJECT_INCLUDE=$PWD/src/specexec/backends/llamacpp/llama_cpp_amx.cmake"'
)


def readme_commands() -> list[str]:
    """The README's two commands: the first bash block's command lines."""
    block = re.search(r"## The two commands.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "the README has no block of its two commands"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command_exactly() -> None:
    install, test = readme_commands()
    assert "specexec generate" in install and "pytest" in test
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test in ci_lines


def test_both_commands_install_through_install_sh_which_builds_llama_cpp_with_rpc_and_the_fix() -> None:
    assert INCLUDE.is_file()
    install, test = readme_commands()
    assert install.startswith("bash install.sh && ") and test.startswith("bash install.sh test && ")
    script = INSTALL.read_text()
    assert BUILD_ARGS in script.splitlines()
    assert "torch==2.13.0" in script  # the CPU build, always pinned
    # An installed or cached build without the RPC backend is rebuilt from source.
    assert "libggml-rpc.so" in script and "--force-reinstall --no-cache-dir --no-deps" in script


def test_install_sh_refuses_an_unknown_target_in_one_line() -> None:
    done = subprocess.run(["bash", str(INSTALL), "tests"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "install.sh: say nothing (the CLI) or 'test' (the test suite), not 'tests'"
    ]


# Shaped like ggml's ggml_tile_config_init: a zeroed 64-byte configuration, its shapes stored, then
# `_tile_loadconfig`, whose inline assembly GCC 12 believes reads 8 bytes.
TILE_CONFIG = """
#include <immintrin.h>
#include <cstdint>
struct tile_config { uint8_t palette = 0; uint8_t start_row = 0; uint8_t reserved[14] = {0};
                     uint16_t colsb[16] = {0}; uint8_t rows[16] = {0}; };
void load_tile_config() {
    alignas(64) tile_config config = {};
    config.palette = 1;
    for (int i = 0; i < 8; ++i) {
        config.rows[i] = i < 2 ? 8 : 16;
        config.colsb[i] = i == 2 || i == 3 ? 32 : 64;
    }
    _tile_loadconfig(&config);
}
"""


def _stores_before_ldtilecfg(obj: Path) -> int:
    """Stores to the stack between the function's entry and its `ldtilecfg` (objdump)."""
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(obj)], capture_output=True, text=True, check=True
    ).stdout
    body = listing.split("<_Z16load_tile_configv>:", 1)[1].split("ldtilecfg", 1)[0]
    return len(re.findall(r"\bmov\w*\s+[^\n]*,\s*-?(?:0x)?[0-9a-f]*\(%r[sb]p\)", body))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AMX is x86-64's")
@pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("cmake", "g++", "objdump")), reason="needs cmake, g++, objdump"
)
def test_the_build_fix_keeps_the_tile_configuration_in_ggmls_amx_file_only(tmp_path: Path) -> None:
    """Compiled only (no AMX needed to run it): ggml-cpu/amx/mmq.cpp keeps every store of the
    configuration; ops.cpp, the same code without the fix, is the negative control."""
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(top CXX)\nadd_subdirectory(ggml/src)\n"
    )
    src = tmp_path / "ggml" / "src"
    (src / "ggml-cpu" / "amx").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(
        "project(ggml CXX)\n"  # a second project(): the include runs again and must not apply twice
        "add_library(ggml-cpu OBJECT ggml-cpu/amx/mmq.cpp ggml-cpu/ops.cpp)\n"
        "target_compile_options(ggml-cpu PRIVATE -O2 -mamx-tile)\n"
    )
    (src / "ggml-cpu" / "amx" / "mmq.cpp").write_text(TILE_CONFIG)
    (src / "ggml-cpu" / "ops.cpp").write_text(TILE_CONFIG)
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(tmp_path), "-B", str(build), f"-DCMAKE_PROJECT_INCLUDE={INCLUDE}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert configure.returncode == 0, configure.stderr
    if "CXX compiler identification is GNU" not in configure.stdout:
        pytest.skip("the fix is for GCC; other compilers build as they are")
    assert configure.stdout.count("compiles") == 1
    assert "mmq.cpp with -fno-tree-dse -fno-dse" in configure.stdout
    made = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    fixed = _stores_before_ldtilecfg(next(build.rglob("mmq.cpp.o")))
    control = _stores_before_ldtilecfg(next(build.rglob("ops.cpp.o")))
    assert fixed >= 4, "the configuration's shapes were not stored"  # 64 bytes: palette, widths, rows
    if control == fixed:
        pytest.skip(f"this compiler keeps the stores without the fix ({control}): nothing to compare")
    assert control <= 2  # the zeroing of the first 16 bytes and the palette: GCC 12's dropped stores

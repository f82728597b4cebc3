"""The README's two commands, CI's command, and the build fixes they hand llama-cpp-python
(src/specexec/backends/llamacpp/llama_cpp_build.cmake), each tried on a small CMake project shaped like
ggml's."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "src" / "specexec" / "backends" / "llamacpp" / "llama_cpp_build.cmake"
INSTALL = ROOT / "install.sh"
BUILD_ARGS = (
    'export CMAKE_ARGS="-DGGML_RPC=ON '
    '-DCMAKE_PROJECT_INCLUDE=$PWD/src/specexec/backends/llamacpp/llama_cpp_build.cmake"'
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
    # An installed or cached build without the RPC backend or its fix is rebuilt from source.
    assert "libggml-rpc.so" in script and "--force-reinstall --no-cache-dir --no-deps" in script
    assert "b'specexec_graph_reuse_safe' in rpc.read_bytes()" in script


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


def _configured(folder: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The CMake project in `folder` configured with the fixes: its build folder and CMake's output."""
    build = folder / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(folder), "-B", str(build), f"-DCMAKE_PROJECT_INCLUDE={INCLUDE}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert configure.returncode == 0, configure.stderr
    return build, configure


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
    build, configure = _configured(tmp_path)
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


# Shaped like ggml-rpc.cpp where the fix changes it: a worker's device context, a buffer freed on it, the
# devices made for a worker, the backend's named functions. main() says whether freeing a buffer on worker
# "a" made the client forget the graph it last sent to "a" (and not to "b"), and whether the fix answers.
RPC_CLIENT = """
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
struct ggml_backend_rpc_device_context { std::string endpoint; uint32_t device; uint64_t last_graph_uid; };
struct ggml_backend_rpc_buffer_type_context { std::string endpoint; };
struct ggml_backend_buffer_type { void * context; };
struct ggml_backend_buffer { ggml_backend_buffer_type * buft; };
typedef ggml_backend_buffer * ggml_backend_buffer_t;
struct ggml_backend_device { void * context; };
typedef ggml_backend_device * ggml_backend_dev_t;

static void ggml_backend_rpc_buffer_free_buffer(ggml_backend_buffer_t buffer) {
    (void)buffer;
}

static ggml_backend_rpc_device_context * add_server(const char * endpoint) {
    for (uint32_t ind = 0; ind < 1; ind++) {
        auto * dev_ctx = new ggml_backend_rpc_device_context {endpoint, ind, 7};
        ggml_backend_dev_t dev = new ggml_backend_device {
            dev_ctx};
        return (ggml_backend_rpc_device_context *)dev->context;
    }
    return nullptr;
}

static void * get_proc_address(const char * name) {
    if (std::strcmp(name, "ggml_backend_rpc_start_server") == 0) {
        return nullptr;
    }
    return nullptr;
}

int main() {
    ggml_backend_rpc_device_context * a = add_server("a");
    ggml_backend_rpc_device_context * b = add_server("b");
    ggml_backend_rpc_buffer_type_context on_a {"a"};
    ggml_backend_buffer_type buft {&on_a};
    ggml_backend_buffer buffer {&buft};
    ggml_backend_rpc_buffer_free_buffer(&buffer);
    std::printf("%d %d %d\\n", (int)a->last_graph_uid, (int)b->last_graph_uid,
                get_proc_address("specexec_graph_reuse_safe") != nullptr);
}
"""


def _rpc_project(folder: Path, source: str) -> tuple[Path, subprocess.CompletedProcess]:
    """A project whose `ggml-rpc` target compiles `source` (a program here), configured with the fixes:
    its build folder and the configuration's output."""
    (folder / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.21)\nproject(top CXX)\nadd_subdirectory(ggml/src/ggml-rpc)\n"
    )
    rpc = folder / "ggml" / "src" / "ggml-rpc"
    rpc.mkdir(parents=True)
    (rpc / "CMakeLists.txt").write_text("project(ggml CXX)\nadd_executable(ggml-rpc ggml-rpc.cpp)\n")
    (rpc / "ggml-rpc.cpp").write_text(source)
    return _configured(folder)


@pytest.mark.skipif(not all(shutil.which(tool) for tool in ("cmake", "g++")), reason="needs cmake, g++")
def test_the_rpc_fix_makes_a_freed_buffer_end_graph_reuse_on_its_worker_only(tmp_path: Path) -> None:
    build, configure = _rpc_project(tmp_path, RPC_CLIENT)
    assert configure.stdout.count("a freed buffer ends graph reuse on its worker") == 1
    made = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    ran = subprocess.run(
        [str(build / "ggml" / "src" / "ggml-rpc" / "ggml-rpc")], capture_output=True, text=True
    )
    assert ran.stdout.split() == ["0", "7", "1"]  # "a" forgot, "b" did not, the fix answers
    # The negative control: the same source without the fix forgets nothing.
    control = subprocess.run(
        ["g++", "-x", "c++", "-", "-o", str(tmp_path / "control")],
        input=RPC_CLIENT,
        capture_output=True,
        text=True,
    )
    assert control.returncode == 0, control.stderr
    ran = subprocess.run([str(tmp_path / "control")], capture_output=True, text=True)
    assert ran.stdout.split() == ["7", "7", "0"]


@pytest.mark.skipif(not shutil.which("cmake"), reason="needs cmake")
def test_the_rpc_fix_leaves_a_ggml_rpc_it_does_not_know_as_it_is(tmp_path: Path) -> None:
    source = RPC_CLIENT.replace("static void ggml_backend_rpc_buffer_free_buffer", "static void free_buffer")
    build, configure = _rpc_project(tmp_path, source)
    warnings = " ".join(configure.stderr.split())  # CMake wraps them
    assert "ggml-rpc.cpp is not the one this fix knows: graphs are not reused over RPC" in warnings
    assert not (build / "specexec").exists()

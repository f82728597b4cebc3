# Passed to llama-cpp-python's build by the README's install commands:
#   CMAKE_ARGS="-DGGML_RPC=ON -DCMAKE_PROJECT_INCLUDE=$PWD/src/specexec/backends/llamacpp/llama_cpp_build.cmake"
# CMake includes it after every project() call of that build. It makes two fixes; each one that cannot
# find what it changes says so and leaves the build as it was.
#
# 1. AMX. GCC's `_tile_loadconfig` (amxtileintrin.h, GCC 12 at least) is inline assembly whose memory
# operand covers 8 of the tile configuration's 64 bytes. At -O1 and above GCC removes the stores of the
# tiles' rows and widths as dead, `ldtilecfg` loads empty tiles, and ggml's first AMX multiply dies of
# SIGILL. ggml's only `ldtilecfg` is in ggml-cpu/amx/mmq.cpp, so that one file is compiled without dead
# store elimination; every other file keeps its flags. Elsewhere than GCC, nothing changes.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND NOT COMMAND specexec_keep_tile_config_stores)
  function(specexec_keep_tile_config_stores)
    set(found FALSE)
    set(folders "${CMAKE_SOURCE_DIR}")
    while(folders)
      list(POP_FRONT folders folder)
      get_property(below DIRECTORY "${folder}" PROPERTY SUBDIRECTORIES)
      list(APPEND folders ${below})
      get_property(targets DIRECTORY "${folder}" PROPERTY BUILDSYSTEM_TARGETS)
      list(FILTER targets INCLUDE REGEX "^ggml-cpu")
      foreach(target IN LISTS targets)
        get_target_property(sources ${target} SOURCES)
        list(FILTER sources INCLUDE REGEX "(^|/)ggml-cpu/amx/mmq\\.cpp$")
        foreach(source IN LISTS sources)
          cmake_path(ABSOLUTE_PATH source BASE_DIRECTORY "${folder}")
          set_property(SOURCE "${source}" TARGET_DIRECTORY ${target}
                       APPEND PROPERTY COMPILE_OPTIONS -fno-tree-dse -fno-dse)
          message(STATUS "specexec: ${target} compiles ${source} with -fno-tree-dse -fno-dse")
          set(found TRUE)
        endforeach()
      endforeach()
    endwhile()
    if(NOT found)
      message(WARNING "specexec: no ggml-cpu target compiles ggml-cpu/amx/mmq.cpp: the AMX fix is not applied")
    endif()
  endfunction()
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL specexec_keep_tile_config_stores)
endif()

# 2. Graph reuse over RPC. A client whose pass has the same graph as its last one on a worker asks the
# worker to compute the graph it stored (RPC_CMD_GRAPH_RECOMPUTE) instead of sending it again (about 240
# KiB a worker for a 1.5B model). The worker forgets its stored graphs whenever a buffer is freed on it,
# but the client does not, so after a context was freed the next reused graph is refused, the worker
# closes the connection and the client aborts. ggml-rpc.cpp is compiled from a copy in which freeing a
# buffer on a worker also makes the client forget the graph it last sent there; the copy answers
# `ggml_backend_reg_get_proc_address(rpc, "specexec_graph_reuse_safe")`, which specexec asks before it
# lets llama.cpp reuse graphs of a model on workers.
if(NOT COMMAND specexec_safe_rpc_graph_reuse)
  function(specexec_safe_rpc_graph_reuse)
    if(NOT TARGET ggml-rpc)
      return()
    endif()
    get_target_property(folder ggml-rpc SOURCE_DIR)
    set(source "${folder}/ggml-rpc.cpp")
    if(NOT EXISTS "${source}")
      message(WARNING "specexec: no ${source}: graphs are not reused over RPC")
      return()
    endif()
    file(READ "${source}" code)
    set(free_buffer "static void ggml_backend_rpc_buffer_free_buffer(ggml_backend_buffer_t buffer) {\n")
    set(new_device "        ggml_backend_dev_t dev = new ggml_backend_device {\n")
    set(proc_address "    if (std::strcmp(name, \"ggml_backend_rpc_start_server\") == 0) {\n")
    foreach(anchor IN ITEMS free_buffer new_device proc_address)
      string(FIND "${code}" "${${anchor}}" first)
      string(FIND "${code}" "${${anchor}}" last REVERSE)
      if(first EQUAL -1 OR NOT first EQUAL last)
        message(WARNING "specexec: ggml-rpc.cpp is not the one this fix knows: graphs are not reused over RPC")
        return()
      endif()
    endforeach()
    string(REPLACE "${free_buffer}" "\
static std::vector<ggml_backend_rpc_device_context *> & specexec_rpc_devices() {
    static std::vector<ggml_backend_rpc_device_context *> devices;
    return devices;
}

// The worker at `endpoint` drops its stored graphs when a buffer is freed: recompute none of them.
static void specexec_forget_graphs(const std::string & endpoint) {
    for (ggml_backend_rpc_device_context * device : specexec_rpc_devices()) {
        if (device->endpoint == endpoint) {
            device->last_graph_uid = 0;
        }
    }
}

${free_buffer}    specexec_forget_graphs(((ggml_backend_rpc_buffer_type_context *)buffer->buft->context)->endpoint);
" code "${code}")
    string(REPLACE "${new_device}" "        specexec_rpc_devices().push_back(dev_ctx);\n${new_device}" code "${code}")
    string(REPLACE "${proc_address}" "\
    if (std::strcmp(name, \"specexec_graph_reuse_safe\") == 0) {
        return (void *)specexec_forget_graphs;
    }
${proc_address}" code "${code}")
    set(copy "${CMAKE_BINARY_DIR}/specexec/ggml-rpc.cpp")
    file(WRITE "${copy}" "${code}")
    get_target_property(sources ggml-rpc SOURCES)
    list(TRANSFORM sources REPLACE "^(.*/)?ggml-rpc\\.cpp$" "${copy}")
    set_property(TARGET ggml-rpc PROPERTY SOURCES ${sources})
    target_include_directories(ggml-rpc PRIVATE "${folder}")
    message(STATUS "specexec: ggml-rpc compiles ${copy}: a freed buffer ends graph reuse on its worker")
  endfunction()
  cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL specexec_safe_rpc_graph_reuse)
endif()

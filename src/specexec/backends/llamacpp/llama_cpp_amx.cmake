# Passed to llama-cpp-python's build by the README's install commands:
#   CMAKE_ARGS="-DCMAKE_PROJECT_INCLUDE=$PWD/src/specexec/backends/llamacpp/llama_cpp_amx.cmake"
# CMake includes it after every project() call of that build.
#
# Why: GCC's `_tile_loadconfig` (amxtileintrin.h, GCC 12 at least) is inline assembly whose memory
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

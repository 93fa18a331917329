# Checks the layer rules: every #include "modelcache/<layer>/..." in a
# layer's public headers (include/modelcache/<layer>/) and sources
# (src/<layer>/) names a layer it may include. Fails naming each offending
# file and line.
#
#   cmake -DSOURCE_DIR=<repository root> -P check_layers.cmake
#
# tools/ (the binaries) and src/tools/ (the CLI's commands, linked by the
# binaries and their tests) may include every layer; no layer may include
# them, which the allowed lists below enforce.
cmake_minimum_required(VERSION 3.22)

# Who may include whom (besides itself), from docs/design.md.
set(allowed_base "")
set(allowed_core base)
set(allowed_device base)
set(allowed_weights core base)
set(allowed_runtime core weights device base)
set(allowed_replay core base)
set(allowed_serve core weights base)
set(layers base core device weights runtime replay serve)

set(violations)
set(checked 0)
foreach(layer IN LISTS layers)
  set(folder ${layer})
  file(GLOB_RECURSE files
    "${SOURCE_DIR}/include/modelcache/${folder}/*"
    "${SOURCE_DIR}/src/${folder}/*")
  list(FILTER files INCLUDE REGEX "\\.(h|hpp|cc|cpp|cu|cuh|inc)$")
  foreach(file IN LISTS files)
    math(EXPR checked "${checked} + 1")
    file(RELATIVE_PATH shown "${SOURCE_DIR}" "${file}")
    # Lines with their numbers: protect the characters that CMake lists
    # treat specially, then split on newlines (empty lines stay elements).
    file(READ "${file}" text)
    string(REPLACE "\\" "/" text "${text}")
    string(REPLACE ";" "," text "${text}")
    string(REPLACE "[" "(" text "${text}")
    string(REPLACE "]" ")" text "${text}")
    string(REPLACE "\n" ";" lines "${text}")
    set(number 0)
    foreach(line IN LISTS lines)
      math(EXPR number "${number} + 1")
      if(NOT line MATCHES "^[ \t]*#[ \t]*include[ \t]*[<\"]([^>\"]*)[>\"]")
        continue()
      endif()
      set(path "${CMAKE_MATCH_1}")
      if(path MATCHES "(^|/)\\.\\./")
        string(CONCAT violation "${shown}:${number}: ${layer} includes "
          "\"${path}\": reach other folders through modelcache/<layer>/")
        list(APPEND violations "${violation}")
        continue()
      endif()
      if(NOT path MATCHES "^modelcache/([^/]+)/")
        continue()  # not ours: the standard library, abseil, a local file
      endif()
      set(target "${CMAKE_MATCH_1}")
      if(target STREQUAL replay_folder)
        set(target replay)
      endif()
      if(NOT target STREQUAL layer AND NOT target IN_LIST allowed_${layer})
        set(may "${allowed_${layer}}")
        if(NOT may)
          set(may "nothing of ours")
        endif()
        list(JOIN may ", " may)
        string(CONCAT violation "${shown}:${number}: ${layer} includes "
          "\"${path}\" (${layer} may include ${may})")
        list(APPEND violations "${violation}")
      endif()
    endforeach()
  endforeach()
endforeach()

if(checked EQUAL 0)
  message(FATAL_ERROR "no sources found under ${SOURCE_DIR}")
endif()
if(violations)
  list(LENGTH violations n)
  list(JOIN violations "\n" text)
  message(FATAL_ERROR "${n} include(s) break the layer rules:\n${text}")
endif()
message(STATUS "layer rules hold in ${checked} files")

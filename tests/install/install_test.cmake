# One step of the install test (see CMakeLists.txt here), run as
#   cmake -DSTEP=install|cmake|pkgconfig|python -D... -P install_test.cmake
# Each step fails with a message that says what was wrong.
cmake_minimum_required(VERSION 3.22)

set(libdir "${PREFIX}/${LIBDIR}")
set(consumer_source "${SOURCE_DIR}/examples/consumer")

# Runs a command; a non-zero exit fails the step with the command's output.
function(run what)
  execute_process(COMMAND ${ARGN}
    RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT result EQUAL 0)
    list(JOIN ARGN " " command)
    message(FATAL_ERROR "${what} failed (${result}):\n${command}\n${out}")
  endif()
  set(run_output "${out}" PARENT_SCOPE)
endfunction()

function(expect_file path)
  if(NOT EXISTS "${PREFIX}/${path}")
    message(FATAL_ERROR "not installed: ${PREFIX}/${path}")
  endif()
endfunction()

# The installed shared libraries: a versioned SONAME each, and only the API
# (names in namespace modelcache and their type information) in the
# dynamic symbol table; nothing from abseil or the standard library.
function(check_shared_libraries)
  find_program(READELF readelf REQUIRED)
  find_program(NM nm REQUIRED)
  find_program(CXXFILT c++filt REQUIRED)
  file(GLOB libraries "${libdir}/libmodelcache_*.so")
  if(NOT libraries)
    message(FATAL_ERROR "no shared libraries under ${libdir}")
  endif()
  foreach(library IN LISTS libraries)
    get_filename_component(name "${library}" NAME)
    run("readelf -d ${name}" ${READELF} -d "${library}")
    if(NOT run_output MATCHES "Library soname: \\[(${name}\\.[0-9.]+)\\]")
      message(FATAL_ERROR "${name}: no versioned SONAME\n${run_output}")
    endif()
    set(soname "${CMAKE_MATCH_1}")
    if(NOT EXISTS "${libdir}/${soname}")
      message(FATAL_ERROR "${name}: SONAME ${soname} is not installed")
    endif()
    execute_process(COMMAND ${NM} -D --defined-only "${library}"
      COMMAND ${CXXFILT}
      RESULT_VARIABLE result OUTPUT_VARIABLE symbols)
    if(NOT result EQUAL 0)
      message(FATAL_ERROR "nm -D ${name} failed")
    endif()
    string(REPLACE ";" "\\;" symbols "${symbols}")
    string(REPLACE "\n" ";" symbols "${symbols}")
    set(leaked)
    set(count 0)
    foreach(line IN LISTS symbols)
      # "<address> <type> <name>"; absolute symbols (type A) are version
      # nodes, not code or data.
      if(NOT line MATCHES "^[0-9a-f]+ ([^A ]) (.*)$")
        continue()
      endif()
      set(symbol "${CMAKE_MATCH_2}")
      math(EXPR count "${count} + 1")
      if(NOT symbol MATCHES "^([A-Za-z -]+ (for|to) )?modelcache::")
        list(APPEND leaked "${symbol}")
      endif()
    endforeach()
    if(leaked)
      list(LENGTH leaked n)
      list(SUBLIST leaked 0 20 shown)
      list(JOIN shown "\n  " shown)
      message(FATAL_ERROR "${name} exports ${n} symbols outside the API, "
        "such as:\n  ${shown}")
    endif()
    message(STATUS "${name}: SONAME ${soname}, "
      "${count} exported symbols, all in namespace modelcache")
  endforeach()
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}"
    --prefix "${PREFIX}")
  # Every public header, and nothing else: src/ keeps the internal ones.
  file(GLOB_RECURSE public RELATIVE "${SOURCE_DIR}/include"
    "${SOURCE_DIR}/include/modelcache/*.h")
  file(GLOB_RECURSE installed RELATIVE "${PREFIX}/include"
    "${PREFIX}/include/*")
  list(SORT public)
  list(SORT installed)
  if(NOT public STREQUAL installed)
    message(FATAL_ERROR "installed headers differ from include/modelcache:\n"
      "public:    ${public}\ninstalled: ${installed}")
  endif()
  expect_file("${LIBDIR}/cmake/modelcache/modelcacheConfig.cmake")
  expect_file("${LIBDIR}/cmake/modelcache/modelcacheConfigVersion.cmake")
  expect_file("${LIBDIR}/cmake/modelcache/modelcacheTargets.cmake")
  expect_file("${LIBDIR}/pkgconfig/modelcache.pc")
  expect_file("bin/modelcache")
  # The installed binary runs from the prefix (with shared libraries: finds
  # them through its RUNPATH, not the build tree).
  run("installed modelcache --help" "${PREFIX}/bin/modelcache" --help)
  if(SHARED)
    check_shared_libraries()
  endif()

elseif(STEP STREQUAL "cmake")
  set(build "${WORK_DIR}/consumer-cmake")
  file(REMOVE_RECURSE "${build}")
  set(args -S "${consumer_source}" -B "${build}" -G "${GENERATOR}"
    "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}"
    "-DCMAKE_CXX_COMPILER=${CXX}"
    "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
    "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}"
    "-DCMAKE_PREFIX_PATH=${PREFIX};${PREFIX_PATH}")
  if(DEFINED CUDA_ROOT)
    list(APPEND args "-DCUDAToolkit_ROOT=${CUDA_ROOT}")
  endif()
  run("configure the consumer" ${CMAKE_COMMAND} ${args})
  # It must have found this prefix, not some other installed modelcache.
  file(STRINGS "${build}/CMakeCache.txt" found REGEX "^modelcache_DIR:")
  if(NOT found STREQUAL
      "modelcache_DIR:PATH=${PREFIX}/${LIBDIR}/cmake/modelcache")
    message(FATAL_ERROR "the consumer found another package: ${found}")
  endif()
  run("build the consumer" ${CMAKE_COMMAND} --build "${build}")
  run("run the consumer" "${build}/consumer")
  message(STATUS "consumer (find_package): ${run_output}")

elseif(STEP STREQUAL "pkgconfig")
  set(ENV{PKG_CONFIG_PATH} "${libdir}/pkgconfig")
  run("pkg-config" ${PKG_CONFIG} --cflags --libs modelcache)
  string(STRIP "${run_output}" flags)
  message(STATUS "pkg-config --cflags --libs modelcache: ${flags}")
  separate_arguments(flags UNIX_COMMAND "${flags}")
  separate_arguments(cxx_flags UNIX_COMMAND
    "${CXX_FLAGS} ${CXX_CONFIG_FLAGS} ${EXE_LINKER_FLAGS}")
  if(SHARED)
    list(APPEND flags "-Wl,-rpath,${libdir}")
  endif()
  set(binary "${WORK_DIR}/consumer-pkgconfig")
  file(REMOVE "${binary}")
  run("build the consumer with pkg-config" "${CXX}" ${cxx_flags} -std=c++20
    "${consumer_source}/main.cc" ${flags} -o "${binary}")
  run("run the consumer" "${binary}")
  message(STATUS "consumer (pkg-config): ${run_output}")

elseif(STEP STREQUAL "python")
  # The Python package from the prefix alone: imported from a folder
  # outside the source and build trees, it must be the installed copy.
  set(site "${PREFIX}/${PYTHON_INSTALL_DIR}")
  expect_file("${PYTHON_INSTALL_DIR}/modelcache/__init__.py")
  expect_file("${PYTHON_INSTALL_DIR}/modelcache/py.typed")
  set(ENV{PYTHONPATH} "${site}")
  execute_process(
    COMMAND "${PYTHON}" -X dev -c [=[
import modelcache, sys
assert modelcache.__file__.startswith(sys.argv[1]), modelcache.__file__
cache = modelcache.Cache(capacity_bytes=100)
with cache.acquire("m", lambda: "model", 10) as m:
    assert m == "model"
print("modelcache", modelcache.__version__, "from", modelcache.__file__)
]=] "${site}"
    WORKING_DIRECTORY "${WORK_DIR}"
    RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "the installed Python package failed:\n${out}")
  endif()
  message(STATUS "${out}")

else()
  message(FATAL_ERROR
    "STEP must be install, cmake, pkgconfig or python: '${STEP}'")
endif()

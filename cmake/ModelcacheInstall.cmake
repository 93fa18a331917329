# The installable package: `cmake --install <build> --prefix P` puts the
# public headers, the layer libraries, the `modelcache` binary, a CMake
# package (find_package(modelcache CONFIG) with modelcache::<layer> targets)
# and a pkg-config file (modelcache.pc) under P.
#
# Included once, at the end of the top-level CMakeLists.txt, so that every
# target exists by now. It works on whichever modelcache_<layer> targets the
# tree defines, so adding, removing or renaming a layer's sources needs no
# change here; a new layer is one word in MODELCACHE_LAYERS.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# A function, so that its many variables stay out of the top-level scope.
function(modelcache_install)
  # Bottom to top: pkg-config lists the libraries in reverse of this order so
  # that a static link resolves every layer after the layers that use it.
  set(MODELCACHE_LAYERS base core device weights replay runtime serve
    serve_client serve_daemon)

  # Pre-1.0 we promise no ABI stability between minor versions, so the SONAME
  # carries major.minor (libmodelcache_core.so.0.1): a binary built against
  # 0.1 must not silently load a 0.2 library. From 1.0 on it is the major.
  if(PROJECT_VERSION_MAJOR EQUAL 0)
    set(MODELCACHE_SOVERSION
      "${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}")
    set(_mc_compatibility SameMinorVersion)
  else()
    set(MODELCACHE_SOVERSION "${PROJECT_VERSION_MAJOR}")
    set(_mc_compatibility SameMajorVersion)
  endif()

  set(_mc_cmake_dir "${CMAKE_INSTALL_LIBDIR}/cmake/modelcache")
  set(_mc_version_script "${CMAKE_CURRENT_LIST_DIR}/modelcache.map")

  # The package's own libraries, plus the internal targets (such as
  # modelcache_warnings) that a static library's link interface names: CMake
  # exports a static library's private dependencies as $<LINK_ONLY:...>, and
  # every target so named must be exported with it. LINK_ONLY carries no
  # compile options, so exporting the warnings target changes no user's flags.
  set(_mc_exported)
  set(_mc_libraries)  # the layers, bottom to top, for pkg-config
  set(_mc_packages)   # packages find_dependency must find, in first-seen order
  set(_mc_pc_requires)
  set(_mc_pc_libs)
  set(_mc_pc_cflags)
  set(_mc_worklist)
  foreach(layer IN LISTS MODELCACHE_LAYERS)
    if(TARGET modelcache_${layer})
      list(APPEND _mc_worklist modelcache_${layer})
      list(APPEND _mc_libraries modelcache_${layer})
    endif()
  endforeach()

  while(_mc_worklist)
    list(POP_FRONT _mc_worklist target)
    if(target IN_LIST _mc_exported)
      continue()
    endif()
    list(APPEND _mc_exported ${target})
    string(REGEX REPLACE "^modelcache_" "" name "${target}")
    get_target_property(type ${target} TYPE)

    if(target IN_LIST _mc_libraries)
      set_target_properties(${target} PROPERTIES
        EXPORT_NAME ${name}
        OUTPUT_NAME modelcache_${name}
        VERSION ${PROJECT_VERSION}
        SOVERSION ${MODELCACHE_SOVERSION})
      # The headers are C++20; users get the standard from the target.
      target_compile_features(${target} PUBLIC cxx_std_20)
    else()
      # Exported only because a static layer's link interface names it.
      set_target_properties(${target} PROPERTIES EXPORT_NAME internal_${name})
    endif()

    if(type STREQUAL "SHARED_LIBRARY")
      # Only the API is exported: names in namespace modelcache, with their
      # type information and vtables. abseil, the standard library's template
      # instances and everything else stay local, so two libraries built
      # against different abseils never clash in one process. A version
      # script needs no export macro in the headers.
      target_link_options(${target} PRIVATE
        "LINKER:--version-script=${_mc_version_script}")
      set_property(TARGET ${target} APPEND PROPERTY
        LINK_DEPENDS "${_mc_version_script}")
      # Installed side by side: each layer finds the layers it links.
      set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN")
    endif()

    # The tree's targets name the include folder by its absolute source path,
    # which an installed package cannot: keep it for the build tree only and
    # point installed users at <prefix>/include.
    get_target_property(includes ${target} INTERFACE_INCLUDE_DIRECTORIES)
    if(includes)
      set(rewritten)
      foreach(dir IN LISTS includes)
        set(in_tree OFF)
        if(NOT dir MATCHES "^\\$<" AND IS_ABSOLUTE "${dir}")
          cmake_path(IS_PREFIX PROJECT_SOURCE_DIR "${dir}" in_source)
          cmake_path(IS_PREFIX PROJECT_BINARY_DIR "${dir}" in_binary)
          if(in_source OR in_binary)
            set(in_tree ON)
          endif()
        endif()
        if(in_tree)
          list(APPEND rewritten "$<BUILD_INTERFACE:${dir}>")
        else()
          list(APPEND rewritten "${dir}")
        endif()
      endforeach()
      set_target_properties(${target} PROPERTIES
        INTERFACE_INCLUDE_DIRECTORIES "${rewritten}")
    endif()
    if(target IN_LIST _mc_libraries)
      target_include_directories(${target} PUBLIC
        "$<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>")
    endif()

    # What the exported link interface needs: our own targets are exported
    # too, imported ones become find_dependency() calls and pkg-config terms.
    get_target_property(links ${target} INTERFACE_LINK_LIBRARIES)
    if(NOT links)
      set(links)
    endif()
    foreach(link IN LISTS links)
      if(link MATCHES "^\\$<LINK_ONLY:(.+)>$")
        set(link "${CMAKE_MATCH_1}")
      endif()
      if(link MATCHES "^modelcache_" AND TARGET ${link})
        list(APPEND _mc_worklist ${link})
      elseif(link MATCHES "^Threads::")
        list(APPEND _mc_packages Threads)
        list(APPEND _mc_pc_libs -pthread)
      elseif(link MATCHES "^CUDA::(.+)$")
        set(cuda_library ${CMAKE_MATCH_1})
        list(APPEND _mc_packages CUDAToolkit)
        # The device layer found the toolkit in its own directory scope; find
        # it again here (cached, so the same one) for its library folder.
        find_package(CUDAToolkit QUIET REQUIRED)
        list(APPEND _mc_pc_libs
          "-L${CUDAToolkit_LIBRARY_DIR}" "-l${cuda_library}")
      elseif(link MATCHES "^ZLIB::")
        list(APPEND _mc_packages ZLIB)
        list(APPEND _mc_pc_requires zlib)
      elseif(link MATCHES "^zstd::")
        list(APPEND _mc_packages zstd)
        list(APPEND _mc_pc_requires libzstd)
      elseif(link MATCHES "^absl::(.+)$")
        list(APPEND _mc_packages absl)
        list(APPEND _mc_pc_requires "absl_${CMAKE_MATCH_1}")
      elseif(link MATCHES "^([A-Za-z0-9_]+)::")
        # nlohmann_json and the like: the namespace is the package's name.
        # Header-only ones add nothing to link, so pkg-config needs nothing.
        list(APPEND _mc_packages ${CMAKE_MATCH_1})
      endif()
    endforeach()
    get_target_property(defines ${target} INTERFACE_COMPILE_DEFINITIONS)
    if(defines)
      foreach(define IN LISTS defines)
        if(NOT define MATCHES "^\\$<")
          list(APPEND _mc_pc_cflags "-D${define}")
        endif()
      endforeach()
    endif()
  endwhile()
  list(REMOVE_DUPLICATES _mc_packages)
  list(REMOVE_DUPLICATES _mc_pc_requires)
  list(REMOVE_DUPLICATES _mc_pc_libs)
  list(REMOVE_DUPLICATES _mc_pc_cflags)

  install(TARGETS ${_mc_exported} EXPORT modelcacheTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  # Public headers only; src/ keeps the internal ones.
  install(DIRECTORY include/modelcache
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
    FILES_MATCHING PATTERN "*.h")
  install(EXPORT modelcacheTargets
    NAMESPACE modelcache::
    DESTINATION ${_mc_cmake_dir})

  if(TARGET modelcache)
    set_target_properties(modelcache PROPERTIES
      INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
    install(TARGETS modelcache RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  endif()

  # modelcacheConfig.cmake: find_dependency() for each package above.
  set(MODELCACHE_FIND_DEPENDENCIES)
  foreach(package IN LISTS _mc_packages)
    string(APPEND MODELCACHE_FIND_DEPENDENCIES "find_dependency(${package})\n")
  endforeach()
  configure_package_config_file(
    ${CMAKE_CURRENT_LIST_DIR}/modelcacheConfig.cmake.in
    ${PROJECT_BINARY_DIR}/modelcacheConfig.cmake
    INSTALL_DESTINATION ${_mc_cmake_dir})
  write_basic_package_version_file(
    ${PROJECT_BINARY_DIR}/modelcacheConfigVersion.cmake
    VERSION ${PROJECT_VERSION}
    COMPATIBILITY ${_mc_compatibility})
  install(FILES
    ${PROJECT_BINARY_DIR}/modelcacheConfig.cmake
    ${PROJECT_BINARY_DIR}/modelcacheConfigVersion.cmake
    DESTINATION ${_mc_cmake_dir})

  # modelcache.pc: every layer in one module, top layer first. A static
  # library's dependencies are public in it (plain `pkg-config --libs` must
  # link), a shared library's are private (it links them itself).
  set(MODELCACHE_PC_LIBS)
  foreach(target IN LISTS _mc_libraries)
    string(PREPEND MODELCACHE_PC_LIBS " -l${target}")
  endforeach()
  list(JOIN _mc_pc_cflags " " MODELCACHE_PC_CFLAGS)
  list(JOIN _mc_pc_requires " " _mc_requires)
  list(JOIN _mc_pc_libs " " _mc_libs)
  if(BUILD_SHARED_LIBS)
    set(MODELCACHE_PC_REQUIRES "")
    set(MODELCACHE_PC_REQUIRES_PRIVATE "${_mc_requires}")
    set(MODELCACHE_PC_LIBS_PRIVATE "${_mc_libs}")
  else()
    set(MODELCACHE_PC_REQUIRES "${_mc_requires}")
    set(MODELCACHE_PC_REQUIRES_PRIVATE "")
    string(APPEND MODELCACHE_PC_LIBS " ${_mc_libs}")
    set(MODELCACHE_PC_LIBS_PRIVATE "")
  endif()
  # Relocatable: the prefix is found from the .pc file's own folder, so an
  # install with --prefix elsewhere than CMAKE_INSTALL_PREFIX still works.
  file(RELATIVE_PATH MODELCACHE_PC_PREFIX_FROM_PCFILEDIR
    "/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/")
  string(REGEX REPLACE "/$" "" MODELCACHE_PC_PREFIX_FROM_PCFILEDIR
    "${MODELCACHE_PC_PREFIX_FROM_PCFILEDIR}")
  configure_file(${CMAKE_CURRENT_LIST_DIR}/modelcache.pc.in
    ${PROJECT_BINARY_DIR}/modelcache.pc @ONLY)
  install(FILES ${PROJECT_BINARY_DIR}/modelcache.pc
    DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
endfunction()

modelcache_install()

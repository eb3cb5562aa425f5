# The installable package (docs/library.md): `cmake --install build --prefix PREFIX` installs
#
#   PREFIX/lib/libstrata.so                 strata's layers from core to train in one shared library
#   PREFIX/include/strata/...               the headers of its C++ API (below), and nothing else
#   PREFIX/lib/cmake/strata/                find_package(strata) -> the target strata::strata
#   PREFIX/bin/strata                       the command
#
# A project then builds against it with find_package(strata) and target_link_libraries(... 
# strata::strata); examples/installed_package is one, built and run by tests/examples.
#
# The library holds every object of the layers the trainer needs (a consumer may use any of
# their symbols); what they link (OpenBLAS, RocksDB, liburing, Gloo, CUDA) stays private to it. The consumer gets the headers' own dependencies: Abseil, protobuf, threads.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(STRATA_PACKAGE_LIBRARIES
    strata_common strata_device strata_kernels strata_proto strata_storage strata_comm
    strata_data strata_model strata_scheduler strata_checkpoint strata_train)

# The API: the trainer (train/trainer.h, its options and results), the MoE layer and its experts
# (runtime/model/), the job config (proto/config_io.h) and the CPU's BLAS kernel choice, with
# every header they include. tests/examples/package_test.cc checks that this list is closed
# under #include and that nothing else is installed.
set(STRATA_PUBLIC_HEADERS
    checkpoint/checkpoint_set.h checkpoint/manager.h checkpoint/tensor_index.h
    core/common/clock.h core/common/logging.h core/common/status.h core/common/thread_pool.h
    core/common/trace.h core/device/device.h
    kernels/blas_kernel.h kernels/ops.h kernels/vocabulary.h
    proto/config_io.h
    runtime/comm/communicator.h runtime/comm/store.h runtime/data/dataset.h
    runtime/model/adamw.h runtime/model/expert.h runtime/model/expert_residency.h
    runtime/model/gate.h runtime/model/moe_layer.h runtime/model/parallel.h
    runtime/model/parameter.h runtime/model/transformer.h
    scheduler/comm_thread.h scheduler/data_parallel.h scheduler/expert_parallel.h
    scheduler/placement.h scheduler/tiered_scheduler.h
    storage/block_io.h storage/copy_shelf.h storage/env.h storage/extent_allocator.h
    storage/io_memory.h storage/private_folder.h storage/slot_arena.h storage/ssd_tier.h
    storage/tiered_store.h
    train/elastic/elastic_state.h train/elastic/state_sync.h train/evaluate.h train/metrics.h
    train/options.h train/step_seams.h train/tier_resources.h train/trainer.h
    train/worker_comms.h)
set(STRATA_GENERATED_HEADERS proto/config.pb.h proto/storage.pb.h)

# Every object of the layers (also those the library itself does not call: a consumer may use
# any); the static libraries are linked too, for what they link (whose objects the archives add
# nothing to: every symbol of theirs is defined already).
set(strata_package_objects)
foreach(lib ${STRATA_PACKAGE_LIBRARIES})
  list(APPEND strata_package_objects $<TARGET_OBJECTS:${lib}>)
endforeach()
add_library(strata_library SHARED ${CMAKE_CURRENT_LIST_DIR}/package.cc ${strata_package_objects})
add_library(strata::strata ALIAS strata_library)
set_target_properties(strata_library PROPERTIES
  OUTPUT_NAME strata EXPORT_NAME strata
  VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
# A missing private dependency fails here, not in a consumer's link.
target_link_options(strata_library PRIVATE -Wl,--no-undefined)
# The installed library and command find CUDA's libraries (and NCCL) where they were found here,
# also where no ld.so.conf.d names them; the system's libraries (OpenBLAS among them, whose
# variant Debian's alternatives choose) come from the loader's own paths.
if(STRATA_WITH_CUDA)
  set(strata_runpath ${CUDAToolkit_LIBRARY_DIR})
  if(STRATA_NCCL_LIBRARY)
    get_filename_component(strata_nccl_dir ${STRATA_NCCL_LIBRARY} DIRECTORY)
    list(APPEND strata_runpath ${strata_nccl_dir})
  endif()
  list(REMOVE_DUPLICATES strata_runpath)
  set_target_properties(strata_library strata PROPERTIES INSTALL_RPATH "${strata_runpath}")
endif()
target_link_libraries(strata_library
  PRIVATE ${STRATA_PACKAGE_LIBRARIES}
  INTERFACE absl::status absl::statusor absl::strings absl::str_format absl::synchronization
            protobuf::libprotobuf Threads::Threads)
target_compile_features(strata_library INTERFACE cxx_std_20)
target_include_directories(strata_library INTERFACE
  $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}> $<BUILD_INTERFACE:${CMAKE_BINARY_DIR}>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/strata>)

install(TARGETS strata_library EXPORT strataTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS strata RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
foreach(header ${STRATA_PUBLIC_HEADERS})
  get_filename_component(folder ${header} DIRECTORY)
  install(FILES ${CMAKE_SOURCE_DIR}/${header}
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${folder})
endforeach()
foreach(header ${STRATA_GENERATED_HEADERS})
  get_filename_component(folder ${header} DIRECTORY)
  install(FILES ${CMAKE_BINARY_DIR}/${header}
          DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${folder})
endforeach()
install(EXPORT strataTargets NAMESPACE strata::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/strataConfig.cmake.in
  ${CMAKE_BINARY_DIR}/package/strataConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)
write_basic_package_version_file(${CMAKE_BINARY_DIR}/package/strataConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/package/strataConfig.cmake
              ${CMAKE_BINARY_DIR}/package/strataConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/strata)

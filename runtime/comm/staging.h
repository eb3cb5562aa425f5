// The staging communicator: collectives on device memory carried by a communicator over host
// memory (Gloo), through page-locked host buffers. It is what workers on GPUs use where NCCL
// cannot serve them: several workers on one GPU (NCCL refuses two ranks on one device), or a
// build or machine without NCCL.
//
// Each operation waits for the work already enqueued on the GPU (a fence on the legacy default
// stream, which the blocking compute stream's kernels precede), copies its input to pinned host
// memory, runs the host communicator's operation
// there, and copies the result back; it returns once the result is on the device (the contract of
// communicator.h: the buffers are free on return). AllReduce goes in chunks of
// StagingOptions::chunk_bytes through two pinned halves: while chunk k is reduced over the
// network, chunk k + 1 is already on its way to the host and chunk k - 1 on its way back, so for
// large buckets the PCIe copies hide behind the network. Every element is summed exactly as the
// host communicator sums it (Gloo: in rank order), so the result is bitwise what the host
// communicator gives on host copies of the same data. AllToAllV, AllGather and Broadcast stage
// whole, through buffers that grow to the largest operation seen and are kept.
//
// On the CPU device the copies are memcpy and the fences are no-ops: the same code runs, and is
// what the CPU tests exercise (tests/runtime/comm_test.cc, with real processes).
//
// Ownership and threads: the staging communicator owns the host communicator it wraps, its copy
// stream and its pinned buffers. As for every Communicator, one thread at a time calls its
// operations; Abort (any thread) is the host communicator's Abort, which ends the operation in
// flight (a copy in flight finishes on its own: it does not wait on a peer). A failed operation
// leaves no copy in flight; a failure of the host operation is the host communicator's (it
// finishes itself where the failure calls for it), and a local one (a copy, a pinned allocation)
// finishes the communicator: the host communicator is aborted so that peers fail at once, and
// every later call is ABORTED. Every rank must use the same chunk_bytes (the chunks are separate
// host operations, matched by order).
#pragma once

#include <cstddef>
#include <memory>

#include "core/common/status.h"
#include "core/device/device.h"
#include "runtime/comm/communicator.h"

namespace strata::comm {

struct StagingOptions {
  // AllReduce moves this much per host operation, in each of two pinned halves (at most 1 GiB).
  // Default 4 MiB: a PCIe copy of well under a millisecond, and a host all-reduce long enough
  // for it to hide behind.
  size_t chunk_bytes = 4ull << 20;
};

// Wraps `host` (connected, over host memory) into a communicator over memory on `device`.
// INVALID_ARGUMENT for a null `host` or a chunk_bytes outside [8, 1 GiB]; the copy stream's error
// where the GPU refuses one.
[[nodiscard]] StatusOr<std::unique_ptr<Communicator>> MakeStaging(
    std::unique_ptr<Communicator> host, Device device, const StagingOptions& options = {});

}  // namespace strata::comm

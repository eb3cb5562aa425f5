// How the process's heap gives memory back (glibc malloc). Process-wide: only a binary's main()
// calls it, once, before it starts threads.
#pragma once

#include <cstddef>

namespace strata {

// Blocks of `bytes` (default 8 MiB) and more are mapped from the OS for each allocation and
// unmapped when freed, instead of coming from the heap. glibc's default raises that threshold up to
// 32 MiB as such blocks are freed, after which blocks of several MiB (an MoE layer's dispatched
// rows, activations) come from the heap; freed in another order than they were taken, they leave it
// fragmented and resident, so a long run's memory grows far past what it uses (docs/storage.md,
// "Measurements behind the design"). Returns false where the C library does not take the setting
// (then nothing changed).
bool KeepLargeBlocksOffTheHeap(size_t bytes = size_t{8} << 20);

}  // namespace strata

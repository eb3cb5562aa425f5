#include "core/common/heap.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace strata {

bool KeepLargeBlocksOffTheHeap(size_t bytes) {
#if defined(__GLIBC__)
  // A fixed threshold also turns off glibc's dynamic raising of it.
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) == 1;
#else
  (void)bytes;
  return false;
#endif
}

}  // namespace strata

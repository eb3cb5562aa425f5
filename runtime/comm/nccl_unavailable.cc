// ConnectNccl in a build without NCCL (no CUDA toolkit was found at configure time).
#include "runtime/comm/communicator.h"

namespace strata::comm {

StatusOr<std::unique_ptr<Communicator>> ConnectNccl(std::shared_ptr<Store>, const CommOptions&,
                                                    int) {
  return absl::UnimplementedError(
      "this strata build has no NCCL: configure with the CUDA toolkit (and its NCCL) installed, "
      "-DSTRATA_CUDA=ON, to get the NCCL communicator; the Gloo communicator carries CPU tensors");
}

}  // namespace strata::comm

// The elastic worker's coordinator over gRPC: train::Membership (train/elastic_worker.h) carried
// out by a CoordinatorClient (coordinator/service.h). `strata worker --coordinator`
// hands one to train::RunElasticWorker.
//
// Each call is the client's call of the same name; errors are the client's, unchanged. Safe for
// concurrent use as far as CoordinatorClient is (every call is one RPC on a thread-safe stub;
// Attach and Detach come from one thread at a time).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "coordinator/service.h"
#include "train/elastic_worker.h"

namespace strata::coordinator {

class MembershipClient : public train::Membership {
 public:
  // `client` (not owned) must outlive this; `address` is where it connected (HOST:PORT).
  MembershipClient(CoordinatorClient* client, std::string address)
      : client_(client), address_(std::move(address)) {}

  std::string address() const override { return address_; }
  StatusOr<coordinator::JoinReply> Join(const coordinator::WorkerInfo& info) override;
  StatusOr<coordinator::Generation> Heartbeat(const std::string& id) override;
  StatusOr<coordinator::Generation> ReportStep(const std::string& id, int64_t generation,
                                               int64_t step, double loss,
                                               double tokens_per_s) override;
  StatusOr<coordinator::Generation> ReportStepWithBalance(
      const std::string& id, int64_t generation, int64_t step, double loss, double tokens_per_s,
      const std::vector<coordinator::MoeLayerBalance>& moe_balance,
      const std::string& metrics_line = "") override;
  StatusOr<coordinator::Generation> ReportStart(
      const std::string& id, int64_t generation, int64_t step,
      const std::vector<int64_t>& experts_per_worker) override;
  Status ReportCheckpoint(const std::string& id, int64_t generation, int64_t step,
                          bool committed) override;
  Status Attach(const std::string& id) override;
  Status Detach(bool finished) override;
  StatusOr<coordinator::CoordinatorRecord> GetStatus() override;
  std::shared_ptr<comm::Store> store() override;

 private:
  CoordinatorClient* client_;
  std::string address_;
};

}  // namespace strata::coordinator

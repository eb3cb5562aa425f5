#include "coordinator/membership_client.h"

namespace strata::coordinator {

StatusOr<coordinator::JoinReply> MembershipClient::Join(const coordinator::WorkerInfo& info) {
  return client_->Join(info);
}

StatusOr<coordinator::Generation> MembershipClient::Heartbeat(const std::string& id) {
  return client_->Heartbeat(id);
}

StatusOr<coordinator::Generation> MembershipClient::ReportStep(const std::string& id,
                                                               int64_t generation, int64_t step,
                                                               double loss, double tokens_per_s) {
  return client_->ReportStep(id, generation, step, loss, tokens_per_s);
}

StatusOr<coordinator::Generation> MembershipClient::ReportStepWithBalance(
    const std::string& id, int64_t generation, int64_t step, double loss, double tokens_per_s,
    const std::vector<coordinator::MoeLayerBalance>& moe_balance, const std::string& metrics_line) {
  return client_->ReportStep(id, generation, step, loss, tokens_per_s, moe_balance, metrics_line);
}

StatusOr<coordinator::Generation> MembershipClient::ReportStart(
    const std::string& id, int64_t generation, int64_t step,
    const std::vector<int64_t>& experts_per_worker) {
  return client_->ReportStart(id, generation, step, experts_per_worker);
}

Status MembershipClient::ReportCheckpoint(const std::string& id, int64_t generation, int64_t step,
                                          bool committed) {
  return client_->Checkpoint(id, generation, step, committed);
}

Status MembershipClient::Attach(const std::string& id) { return client_->Attach(id); }

Status MembershipClient::Detach(bool finished) { return client_->Detach(finished); }

StatusOr<coordinator::CoordinatorRecord> MembershipClient::GetStatus() {
  return client_->GetStatus();
}

std::shared_ptr<comm::Store> MembershipClient::store() { return client_->store(); }

}  // namespace strata::coordinator

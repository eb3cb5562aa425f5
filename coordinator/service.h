// The coordinator over gRPC: CoordinatorServer serves a CoordinatorState (proto/coordinator.proto's
// service) and runs its failure detector; CoordinatorClient is the worker's side, including the
// rendezvous comm::Store over the network.
//
// The job token travels in the "strata-token" metadata entry of every call. The server listens on
// loopback unless given another address; with certificate files it uses TLS (gRPC SSL
// credentials), and clients then need the CA certificate.
//
// Threads. CoordinatorServer: gRPC's server threads run the calls (an Attach stream holds one for
// as long as the worker is attached, a KvWait up to its timeout) and a thread of its own calls
// CoordinatorState::Tick every 100 ms; the state, safe for concurrent use, must outlive the
// server. Its destructor stops that thread, then shuts gRPC down, cancelling the calls still open
// after one second (an Attach stream so ended is not the worker's failure: the record keeps it
// in its generation for a restarted coordinator) and waiting for them. CoordinatorClient: every
// call is one RPC on a thread-safe stub and may run on any thread at the same time as others,
// except that Attach and Detach (which replace the open stream) come from one thread at a time; set
// rpc_timeout before the calls begin. Calls fail fast while the coordinator is unreachable (after
// waiting up to 200 ms for the channel to connect, which drives the reconnection). The destructor
// cancels a stream still open, which the coordinator counts as a failure. store() returns a Store
// that shares the channel, may outlive the client and may be used from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/state.h"
#include "core/common/status.h"
#include "proto/coordinator.pb.h"
#include "runtime/comm/store.h"

namespace grpc {
class Channel;
class Server;
}  // namespace grpc

namespace strata::coordinator {

struct TlsFiles {
  std::string cert, key, ca;  // PEM files; all empty: no TLS
};

class CoordinatorServer {
 public:
  // Serves `state` (not owned) on `listen` ("127.0.0.1:0" picks a free port).
  [[nodiscard]] static StatusOr<std::unique_ptr<CoordinatorServer>> Start(CoordinatorState* state,
                                                                          const std::string& listen,
                                                                          const TlsFiles& tls = {});
  ~CoordinatorServer();  // stops serving and the failure detector
  int port() const { return port_; }
  std::string address() const;

 private:
  CoordinatorServer() = default;
  class Service;
  CoordinatorState* state_ = nullptr;
  std::string host_;
  int port_ = 0;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stop_{false};
  std::thread ticker_;
};

class CoordinatorClient {
 public:
  // `tls_ca`: the CA certificate file when the server uses TLS; empty for plaintext. Fails with
  // UNAVAILABLE when the coordinator cannot be reached within `connect_timeout`.
  [[nodiscard]] static StatusOr<std::unique_ptr<CoordinatorClient>> Connect(
      const std::string& address, const std::string& token, const std::string& tls_ca = "",
      std::chrono::milliseconds connect_timeout = std::chrono::milliseconds(5000));
  ~CoordinatorClient();

  [[nodiscard]] StatusOr<coordinator::JoinReply> Join(const coordinator::WorkerInfo& info);
  [[nodiscard]] StatusOr<coordinator::Generation> Heartbeat(const std::string& id);
  // Worker `id` finished `step`; rank 0 gives each MoE layer's load balance in it and the step's
  // metrics line (see CoordinatorState::ReportStep).
  [[nodiscard]] StatusOr<coordinator::Generation> ReportStep(
      const std::string& id, int64_t generation, int64_t step, double loss = 0,
      double tokens_per_s = 0, const std::vector<coordinator::MoeLayerBalance>& moe_balance = {},
      const std::string& metrics_line = "");
  // Rank 0: checkpoint `step` is being written (commit false) or is durable (commit true).
  [[nodiscard]] Status Checkpoint(const std::string& id, int64_t generation, int64_t step,
                                  bool commit);
  // The worker begins `generation` at `step` (see CoordinatorState::ReportStart).
  [[nodiscard]] StatusOr<coordinator::Generation> ReportStart(
      const std::string& id, int64_t generation, int64_t step,
      const std::vector<int64_t>& experts_per_worker = {});
  [[nodiscard]] Status Leave(const std::string& id);
  // Opens the stream the coordinator watches: if this process dies, the coordinator sees the
  // worker fail at once. Detach(true) closes it as finished (not a failure).
  [[nodiscard]] Status Attach(const std::string& id);
  [[nodiscard]] Status Detach(bool finished);
  [[nodiscard]] StatusOr<coordinator::CoordinatorRecord> GetStatus();
  // The rendezvous store on the coordinator.
  std::shared_ptr<comm::Store> store();

  // Each call's deadline (except Wait, which gets its own timeout plus this).
  std::chrono::milliseconds rpc_timeout{5000};

 private:
  CoordinatorClient() = default;
  [[nodiscard]] StatusOr<coordinator::Generation> Report(const coordinator::StepReport& req);
  class Stub;
  class Store;
  class Attachment;
  std::unique_ptr<Attachment> attachment_;
  std::string address_, token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Stub> stub_;
};

}  // namespace strata::coordinator

#include "coordinator/service.h"

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <fstream>
#include <sstream>

#include "absl/strings/str_format.h"
#include "proto/coordinator.grpc.pb.h"

namespace strata::coordinator {

namespace {

constexpr char kTokenKey[] = "strata-token";

grpc::Status ToGrpc(const Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

Status FromGrpc(const grpc::Status& s, const std::string& what, const std::string& address) {
  if (s.ok()) return absl::OkStatus();
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrFormat(
        "%s: the coordinator at %s is unreachable (%s); is `strata coordinator` running there?",
        what, address, s.error_message()));
  }
  return Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

std::string TokenOf(const grpc::ServerContext* ctx) {
  auto it = ctx->client_metadata().find(kTokenKey);
  if (it == ctx->client_metadata().end()) return "";
  return std::string(it->second.data(), it->second.size());
}

StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream f(path);
  if (!f) {
    return absl::NotFoundError(absl::StrFormat("cannot read the TLS %s file '%s'", what, path));
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

class CoordinatorServer::Service final : public coordinator::Coordinator::Service {
 public:
  explicit Service(CoordinatorState* state) : state_(state) {}
  using Now = std::chrono::steady_clock;

  grpc::Status Join(grpc::ServerContext* ctx, const coordinator::WorkerInfo* req,
                    coordinator::JoinReply* resp) override {
    auto r = state_->Join(TokenOf(ctx), *req, Now::now());
    if (!r.ok()) return ToGrpc(r.status());
    resp->set_admitted(r->admitted);
    resp->set_generation(r->generation);
    resp->set_rank(r->rank);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const coordinator::WorkerId* req,
                         coordinator::Generation* resp) override {
    auto r = state_->Heartbeat(TokenOf(ctx), req->id(), Now::now());
    if (!r.ok()) return ToGrpc(r.status());
    *resp = *r;
    return grpc::Status::OK;
  }
  grpc::Status ReportStep(grpc::ServerContext* ctx, const coordinator::StepReport* req,
                          coordinator::Generation* resp) override {
    auto r =
        req->start()
            ? state_->ReportStart(
                  TokenOf(ctx), req->id(), req->generation(), req->step(),
                  {req->experts_per_worker().begin(), req->experts_per_worker().end()}, Now::now())
            : state_->ReportStep(TokenOf(ctx), req->id(), req->generation(), req->step(),
                                 Now::now(), req->loss(), req->tokens_per_s(),
                                 {req->moe_balance().begin(), req->moe_balance().end()},
                                 req->metrics_line());
    if (!r.ok()) return ToGrpc(r.status());
    *resp = *r;
    return grpc::Status::OK;
  }
  grpc::Status Checkpoint(grpc::ServerContext* ctx, const coordinator::CheckpointReport* req,
                          coordinator::Empty*) override {
    return ToGrpc(
        state_->Checkpoint(TokenOf(ctx), req->id(), req->generation(), req->step(), req->commit()));
  }
  grpc::Status Leave(grpc::ServerContext* ctx, const coordinator::WorkerId* req,
                     coordinator::Empty*) override {
    return ToGrpc(state_->Leave(TokenOf(ctx), req->id(), Now::now()));
  }
  grpc::Status Attach(grpc::ServerContext* ctx,
                      grpc::ServerReader<coordinator::AttachMessage>* reader,
                      coordinator::Empty*) override {
    Status auth = state_->Authenticate(TokenOf(ctx));
    if (!auth.ok()) return ToGrpc(auth);
    coordinator::AttachMessage m;
    if (!reader->Read(&m) || m.id().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "Attach: the first message must name the worker");
    }
    const std::string id = m.id();
    bool finished = m.finished();
    while (!finished && reader->Read(&m)) finished = m.finished();
    if (finished) {
      state_->Finished(id);
    } else if (!stopping_.load()) {
      (void)state_->StreamBroken(id, Now::now());
    }
    // A stream the stopping server cut is not the worker's failure: the record keeps it, and a
    // restarted coordinator gives it elastic.restart_grace_ms to come back.
    return grpc::Status::OK;
  }
  grpc::Status KvSet(grpc::ServerContext* ctx, const coordinator::KeyValue* req,
                     coordinator::Empty*) override {
    return ToGrpc(state_->Set(TokenOf(ctx), req->key(), req->value()));
  }
  grpc::Status KvGet(grpc::ServerContext* ctx, const coordinator::Key* req,
                     coordinator::KeyValue* resp) override {
    auto r = state_->Get(TokenOf(ctx), req->key());
    if (!r.ok()) return ToGrpc(r.status());
    resp->set_key(req->key());
    resp->set_value(*r);
    return grpc::Status::OK;
  }
  grpc::Status KvWait(grpc::ServerContext* ctx, const coordinator::KeyWait* req,
                      coordinator::Empty*) override {
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    return ToGrpc(state_->Wait(TokenOf(ctx), keys,
                               std::chrono::milliseconds(std::max<int64_t>(0, req->timeout_ms()))));
  }
  grpc::Status KvAdd(grpc::ServerContext* ctx, const coordinator::KeyAdd* req,
                     coordinator::KeyAddReply* resp) override {
    auto r = state_->Add(TokenOf(ctx), req->key(), req->delta());
    if (!r.ok()) return ToGrpc(r.status());
    resp->set_value(*r);
    return grpc::Status::OK;
  }
  grpc::Status GetStatus(grpc::ServerContext* ctx, const coordinator::Empty*,
                         coordinator::CoordinatorRecord* resp) override {
    Status s = state_->Authenticate(TokenOf(ctx));
    if (!s.ok()) return ToGrpc(s);
    *resp = state_->Snapshot();
    return grpc::Status::OK;
  }

  // From the server's destructor, before gRPC cancels the calls still open.
  void Stop() { stopping_ = true; }

 private:
  CoordinatorState* state_;
  std::atomic<bool> stopping_{false};
};

StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(CoordinatorState* state,
                                                                      const std::string& listen,
                                                                      const TlsFiles& tls) {
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer);
  s->state_ = state;
  s->service_ = std::make_unique<Service>(state);
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::InsecureServerCredentials();
  if (!tls.cert.empty() || !tls.key.empty()) {
    ASSIGN_OR_RETURN(std::string cert, ReadPem(tls.cert, "certificate"));
    ASSIGN_OR_RETURN(std::string key, ReadPem(tls.key, "key"));
    grpc::SslServerCredentialsOptions o;
    o.pem_key_cert_pairs.push_back({key, cert});
    creds = grpc::SslServerCredentials(o);
  }
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, creds, &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrFormat(
        "the coordinator cannot listen on '%s' (address in use, or not an address of this "
        "machine); choose another with --listen HOST:PORT",
        listen));
  }
  s->host_ = listen.substr(0, listen.rfind(':'));
  s->ticker_ = std::thread([ptr = s.get()] {
    while (!ptr->stop_.load()) {
      (void)ptr->state_->Tick(std::chrono::steady_clock::now());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  return s;
}

CoordinatorServer::~CoordinatorServer() {
  stop_ = true;
  if (ticker_.joinable()) ticker_.join();
  if (service_) service_->Stop();
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

std::string CoordinatorServer::address() const { return absl::StrFormat("%s:%d", host_, port_); }

class CoordinatorClient::Stub {
 public:
  std::unique_ptr<coordinator::Coordinator::Stub> s;
};

class CoordinatorClient::Attachment {
 public:
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientWriter<coordinator::AttachMessage>> writer;
  coordinator::Empty reply;
};

namespace {

void Prepare(grpc::ClientContext* ctx, const std::string& token, std::chrono::milliseconds t) {
  ctx->AddMetadata(kTokenKey, token);
  ctx->set_deadline(std::chrono::system_clock::now() + t);
}

// A call that failed because its channel is (re)connecting waits up to this long for it to
// connect before it returns. A synchronous client's channel notices its TCP connect completing
// only while something waits on it, otherwise at gRPC's backup poll every 5 s: fail-fast
// heartbeats found a restarted coordinator 2.3 to 10 s after it listened, past a restart grace of
// a few seconds. The calls themselves stay fail-fast: a heartbeat that fails marks the outage,
// after which the worker attaches its stream to the restarted coordinator again.
constexpr auto kReconnectWait = std::chrono::milliseconds(200);

Status Finish(grpc::Channel& channel, const grpc::Status& s, const std::string& what,
              const std::string& address) {
  if (s.error_code() == grpc::StatusCode::UNAVAILABLE) {
    (void)channel.WaitForConnected(std::chrono::system_clock::now() + kReconnectWait);
  }
  return FromGrpc(s, what, address);
}

}  // namespace

class CoordinatorClient::Store : public comm::Store {
 public:
  Store(std::shared_ptr<grpc::Channel> channel, std::string token, std::string address,
        std::chrono::milliseconds rpc_timeout)
      : channel_(channel),
        stub_(coordinator::Coordinator::NewStub(channel)),
        token_(std::move(token)),
        address_(std::move(address)),
        rpc_timeout_(rpc_timeout) {}
  Status Set(const std::string& key, const std::string& value) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, token_, rpc_timeout_);
    coordinator::KeyValue req;
    req.set_key(key);
    req.set_value(value);
    coordinator::Empty resp;
    return Finish(*channel_, stub_->KvSet(&ctx, req, &resp), "store Set", address_);
  }
  StatusOr<std::string> Get(const std::string& key) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, token_, rpc_timeout_);
    coordinator::Key req;
    req.set_key(key);
    coordinator::KeyValue resp;
    RETURN_IF_ERROR(Finish(*channel_, stub_->KvGet(&ctx, req, &resp), "store Get", address_));
    return resp.value();
  }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, token_, timeout + rpc_timeout_);
    coordinator::KeyWait req;
    for (const auto& k : keys) req.add_keys(k);
    req.set_timeout_ms(timeout.count());
    coordinator::Empty resp;
    return Finish(*channel_, stub_->KvWait(&ctx, req, &resp), "store Wait", address_);
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    grpc::ClientContext ctx;
    Prepare(&ctx, token_, rpc_timeout_);
    coordinator::KeyAdd req;
    req.set_key(key);
    req.set_delta(delta);
    coordinator::KeyAddReply resp;
    RETURN_IF_ERROR(Finish(*channel_, stub_->KvAdd(&ctx, req, &resp), "store Add", address_));
    return resp.value();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<coordinator::Coordinator::Stub> stub_;
  std::string token_, address_;
  std::chrono::milliseconds rpc_timeout_;
};

StatusOr<std::unique_ptr<CoordinatorClient>> CoordinatorClient::Connect(
    const std::string& address, const std::string& token, const std::string& tls_ca,
    std::chrono::milliseconds connect_timeout) {
  std::unique_ptr<CoordinatorClient> c(new CoordinatorClient);
  c->address_ = address;
  c->token_ = token;
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!tls_ca.empty()) {
    ASSIGN_OR_RETURN(std::string ca, ReadPem(tls_ca, "CA certificate"));
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ca;
    creds = grpc::SslCredentials(o);
  }
  // A coordinator that restarts must be found again within a heartbeat timeout: gRPC's default
  // reconnect backoff grows to minutes, so cap it well below the timeout.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  c->channel_ = grpc::CreateCustomChannel(address, creds, args);
  if (!c->channel_->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
    return absl::UnavailableError(absl::StrFormat(
        "cannot reach the coordinator at %s within %d ms; is `strata coordinator` running there?",
        address, connect_timeout.count()));
  }
  c->stub_ = std::make_unique<Stub>();
  c->stub_->s = coordinator::Coordinator::NewStub(c->channel_);
  return c;
}

CoordinatorClient::~CoordinatorClient() {
  if (attachment_) {
    attachment_->ctx->TryCancel();  // not finished: the coordinator counts it as a failure
    (void)attachment_->writer->Finish();
  }
}

StatusOr<coordinator::JoinReply> CoordinatorClient::Join(const coordinator::WorkerInfo& info) {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::JoinReply resp;
  RETURN_IF_ERROR(Finish(*channel_, stub_->s->Join(&ctx, info, &resp), "Join", address_));
  return resp;
}

StatusOr<coordinator::Generation> CoordinatorClient::Heartbeat(const std::string& id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::WorkerId req;
  req.set_id(id);
  coordinator::Generation resp;
  RETURN_IF_ERROR(Finish(*channel_, stub_->s->Heartbeat(&ctx, req, &resp), "Heartbeat", address_));
  return resp;
}

StatusOr<coordinator::Generation> CoordinatorClient::ReportStep(
    const std::string& id, int64_t generation, int64_t step, double loss, double tokens_per_s,
    const std::vector<coordinator::MoeLayerBalance>& moe_balance, const std::string& metrics_line) {
  coordinator::StepReport req;
  req.set_id(id);
  req.set_generation(generation);
  req.set_step(step);
  req.set_loss(loss);
  if (tokens_per_s > 0) req.set_tokens_per_s(tokens_per_s);
  for (const auto& b : moe_balance) *req.add_moe_balance() = b;
  if (!metrics_line.empty()) req.set_metrics_line(metrics_line);
  return Report(req);
}

StatusOr<coordinator::Generation> CoordinatorClient::ReportStart(
    const std::string& id, int64_t generation, int64_t step,
    const std::vector<int64_t>& experts_per_worker) {
  coordinator::StepReport req;
  req.set_id(id);
  req.set_generation(generation);
  req.set_step(step);
  req.set_start(true);
  for (int64_t n : experts_per_worker) req.add_experts_per_worker(n);
  return Report(req);
}

StatusOr<coordinator::Generation> CoordinatorClient::Report(const coordinator::StepReport& req) {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::Generation resp;
  RETURN_IF_ERROR(
      Finish(*channel_, stub_->s->ReportStep(&ctx, req, &resp), "ReportStep", address_));
  return resp;
}

Status CoordinatorClient::Checkpoint(const std::string& id, int64_t generation, int64_t step,
                                     bool commit) {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::CheckpointReport req;
  req.set_id(id);
  req.set_generation(generation);
  req.set_step(step);
  req.set_commit(commit);
  coordinator::Empty resp;
  return Finish(*channel_, stub_->s->Checkpoint(&ctx, req, &resp), "Checkpoint", address_);
}

Status CoordinatorClient::Leave(const std::string& id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::WorkerId req;
  req.set_id(id);
  coordinator::Empty resp;
  return Finish(*channel_, stub_->s->Leave(&ctx, req, &resp), "Leave", address_);
}

StatusOr<coordinator::CoordinatorRecord> CoordinatorClient::GetStatus() {
  grpc::ClientContext ctx;
  Prepare(&ctx, token_, rpc_timeout);
  coordinator::Empty req;
  coordinator::CoordinatorRecord resp;
  RETURN_IF_ERROR(Finish(*channel_, stub_->s->GetStatus(&ctx, req, &resp), "GetStatus", address_));
  return resp;
}

Status CoordinatorClient::Attach(const std::string& id) {
  if (attachment_) {
    // Attaching again once a coordinator that did not answer answers again. One that only stood
    // still (a synced write a busy disk held up) still holds this stream, and ending it would be
    // this worker's failure: a message it reads keeps it. A restarted one lost the stream with its
    // old process, and the write fails.
    coordinator::AttachMessage m;
    m.set_id(id);
    if (attachment_->writer->Write(m)) return absl::OkStatus();
    auto broken = std::move(attachment_);
    (void)broken->writer->Finish();
  }
  auto a = std::make_unique<Attachment>();
  a->ctx = std::make_unique<grpc::ClientContext>();
  a->ctx->AddMetadata(kTokenKey, token_);
  a->writer = stub_->s->Attach(a->ctx.get(), &a->reply);
  coordinator::AttachMessage m;
  m.set_id(id);
  if (!a->writer->Write(m)) {
    return FromGrpc(a->writer->Finish(), "Attach", address_);
  }
  attachment_ = std::move(a);
  return absl::OkStatus();
}

Status CoordinatorClient::Detach(bool finished) {
  if (!attachment_) return absl::OkStatus();
  auto a = std::move(attachment_);
  if (finished) {
    coordinator::AttachMessage m;
    m.set_finished(true);
    (void)a->writer->Write(m);
  }
  a->writer->WritesDone();
  return FromGrpc(a->writer->Finish(), "Attach", address_);
}

std::shared_ptr<comm::Store> CoordinatorClient::store() {
  return std::make_shared<Store>(channel_, token_, address_, rpc_timeout);
}

}  // namespace strata::coordinator

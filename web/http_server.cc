#include "web/http_server.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>

#include <strings.h>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/common/logging.h"

namespace strata::web {
namespace {

// Equal without revealing where the two first differ.
bool SameToken(const std::string& given, const std::string& token) {
  if (given.size() != token.size() || token.empty()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < token.size(); ++i) diff |= given[i] ^ token[i];
  return diff == 0;
}

// libmicrohttpd's own messages (a malformed request, a reset connection) go to the debug log:
// they are a client's doing, not the job's. The last one is kept for a daemon that fails to start.
thread_local std::string last_message;
void LogMessage(void*, const char* format, va_list args) {
  char line[512];
  std::vsnprintf(line, sizeof(line), format, args);
  last_message = line;
  while (!last_message.empty() && last_message.back() == '\n') last_message.pop_back();
  STRATA_LOG(DEBUG) << "http: " << last_message;
}

MHD_Result CollectArg(void* cls, MHD_ValueKind, const char* key, const char* value) {
  if (key != nullptr)
    (*static_cast<std::map<std::string, std::string>*>(cls))[key] = value ? value : "";
  return MHD_YES;
}

MHD_Result Handle(void* cls, MHD_Connection* conn, const char* url, const char* method, const char*,
                  const char*, size_t*, void**) {
  const auto* server = static_cast<const HttpServer*>(cls);
  HttpRequest request;
  request.method = method != nullptr ? method : "";
  request.path = url != nullptr ? url : "";
  MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, &CollectArg, &request.args);
  std::string given;
  if (const char* auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
      auth != nullptr && strncasecmp(auth, "Bearer ", 7) == 0) {  // the scheme: any case
    given = auth + 7;
  } else if (const char* t = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Strata-Token");
             t != nullptr) {
    given = t;
  } else if (auto it = request.args.find("token"); it != request.args.end()) {
    given = it->second;
  }
  const HttpResponse r = server->Respond(request, given);
  MHD_Response* response = MHD_create_response_from_buffer(
      r.body.size(), const_cast<char*>(r.body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return MHD_NO;
  MHD_add_response_header(response, "Content-Type", r.content_type.c_str());
  MHD_add_response_header(response, "Cache-Control", "no-store");
  if (r.status == 401) MHD_add_response_header(response, "WWW-Authenticate", "Bearer");
  if (r.status == 405) MHD_add_response_header(response, "Allow", "GET, HEAD");
  const MHD_Result queued = MHD_queue_response(conn, static_cast<unsigned>(r.status), response);
  MHD_destroy_response(response);
  return queued;
}

StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  if (!in || s.str().empty()) {
    return absl::NotFoundError(absl::StrFormat("cannot read the %s '%s'", what, path));
  }
  return s.str();
}

}  // namespace

StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(const HttpOptions& options,
                                                        std::map<std::string, HttpHandler> routes) {
  const size_t colon = options.address.rfind(':');
  int port = -1;
  std::string host = colon == std::string::npos ? "" : options.address.substr(0, colon);
  if (host == "localhost") host = "127.0.0.1";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (host.empty() || !absl::SimpleAtoi(options.address.substr(colon + 1), &port) || port < 0 ||
      port > 65535 || inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "--http '%s' is not HOST:PORT with an IPv4 HOST (e.g. 127.0.0.1:8080; port 0 takes a "
        "free one)",
        options.address));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool tls = !options.tls_cert.empty();
  std::string cert, key;
  if (tls) {
    if (!SupportsTls()) {
      return absl::FailedPreconditionError(
          "this machine's libmicrohttpd has no TLS: serve HTTP without a certificate");
    }
    ASSIGN_OR_RETURN(cert, ReadPem(options.tls_cert, "TLS certificate"));
    ASSIGN_OR_RETURN(key, ReadPem(options.tls_key, "TLS private key"));
  }

  std::unique_ptr<HttpServer> server(new HttpServer);
  server->token_ = options.token;
  server->routes_ = std::move(routes);
  // select(): a client that half-closes an unfinished request is let go at once (with poll() or
  // epoll it holds a connection until the timeout). Its limit: a connection whose descriptor is
  // past FD_SETSIZE (1024) is refused, so a process holding a thousand files serves no more.
  const unsigned flags =
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG | (tls ? MHD_USE_TLS : 0);
  last_message.clear();
  MHD_OptionItem tls_options[] = {
      {tls ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, 0, cert.data()},
      {tls ? MHD_OPTION_HTTPS_MEM_KEY : MHD_OPTION_END, 0, key.data()},
      {MHD_OPTION_END, 0, nullptr},
  };
  server->daemon_ = MHD_start_daemon(
      flags, 0, nullptr, nullptr, &Handle, server.get(),                                 //
      MHD_OPTION_SOCK_ADDR, reinterpret_cast<const sockaddr*>(&addr),                    //
      MHD_OPTION_THREAD_POOL_SIZE, static_cast<unsigned>(std::max(1, options.threads)),  //
      MHD_OPTION_CONNECTION_TIMEOUT, 10u,                                                //
      MHD_OPTION_CONNECTION_LIMIT, 64u,                                                  //
      MHD_OPTION_EXTERNAL_LOGGER, &LogMessage, nullptr,                                  //
      MHD_OPTION_ARRAY, tls_options,                                                     //
      MHD_OPTION_END);
  if (server->daemon_ == nullptr) {
    return absl::UnavailableError(absl::StrFormat(
        "cannot serve HTTP on %s: %s (is the port taken? port 0 takes a free one)", options.address,
        last_message.empty() ? "the server did not start" : last_message));
  }
  const MHD_DaemonInfo* bound = MHD_get_daemon_info(server->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  server->port_ = bound != nullptr ? bound->port : port;
  server->base_url_ = absl::StrCat(tls ? "https://" : "http://",
                                   host == "0.0.0.0" ? "127.0.0.1" : host, ":", server->port_);
  return server;
}

bool HttpServer::SupportsTls() { return MHD_is_feature_supported(MHD_FEATURE_TLS) == MHD_YES; }

HttpServer::~HttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
}

HttpResponse HttpServer::Respond(const HttpRequest& request, const std::string& given) const {
  HttpResponse response;
  if (!token_.empty() && !SameToken(given, token_)) {
    response.status = 401;
    response.body = given.empty() ? "the job token is required: the header Authorization: Bearer "
                                    "TOKEN, or ?token=TOKEN in the URL\n"
                                  : "wrong job token\n";
    return response;
  }
  auto route = routes_.find(request.path);
  if (route == routes_.end()) {
    response.status = 404;
    response.body = absl::StrCat("no page ", request.path, "\n");
  } else if (request.method != "GET" && request.method != "HEAD") {
    response.status = 405;
    response.body = absl::StrCat(request.method, " is not served; use GET\n");
  } else {
    response = route->second(request);
  }
  return response;
}

}  // namespace strata::web

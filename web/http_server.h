// HttpServer: strata's HTTP endpoint (the dashboard, /metrics, /api/...), on GNU libmicrohttpd.
//
// A server serves a fixed set of routes, given at Start: exact paths, GET (and HEAD) only. Every
// request must carry the job token when one is set — `Authorization: Bearer TOKEN`, the header
// `X-Strata-Token: TOKEN`, or `?token=TOKEN` in the URL (what a browser can open) — or it is
// answered 401; an unknown path 404, another method 405. Malformed requests are libmicrohttpd's to
// refuse (400); the server goes on serving.
//
// (Not civetweb: Debian's is built with a fixed 100 KiB thread stack, and glibc refuses to start
// such a thread in a process whose libraries' static thread-local storage is larger — cuBLASLt's
// and OpenBLAS's are, in every strata binary.)
//
// Threads: libmicrohttpd's threads (HttpOptions::threads) call the handlers, possibly several at
// once, so a handler must be safe to call from any thread. The server owns its daemon; the
// destructor stops it, waiting for handlers that are running, so whatever a handler reads must
// outlive the server.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "core/common/status.h"

struct MHD_Daemon;

namespace strata::web {

struct HttpRequest {
  std::string method;                       // "GET" or "HEAD"
  std::string path;                         // without the query
  std::map<std::string, std::string> args;  // the query's, decoded
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

struct HttpOptions {
  // HOST:PORT to listen on; port 0 takes a free one (HttpServer::port() says which). HOST is an
  // IPv4 address or "localhost"; "0.0.0.0" listens on every interface.
  std::string address = "127.0.0.1:0";
  // The job token every request must carry; "" serves without one (tests only: the launcher
  // always sets one).
  std::string token;
  // PEM files of a certificate and its private key: serve HTTPS instead of HTTP.
  std::string tls_cert, tls_key;
  int threads = 2;
};

class HttpServer {
 public:
  // Listens on options.address and serves `routes` (path -> handler) until destroyed.
  [[nodiscard]] static StatusOr<std::unique_ptr<HttpServer>> Start(
      const HttpOptions& options, std::map<std::string, HttpHandler> routes);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Whether this machine's libmicrohttpd serves HTTPS (HttpOptions::tls_cert).
  static bool SupportsTls();

  int port() const { return port_; }
  // "http://HOST:PORT" (https with a certificate), HOST as given ("0.0.0.0" as 127.0.0.1).
  const std::string& base_url() const { return base_url_; }

  // What `request` gets, given the token it carried ("" when none): the daemon's threads call it.
  HttpResponse Respond(const HttpRequest& request, const std::string& given_token) const;

 private:
  HttpServer() = default;

  std::string token_;
  std::map<std::string, HttpHandler> routes_;
  MHD_Daemon* daemon_ = nullptr;
  int port_ = 0;
  std::string base_url_;
};

}  // namespace strata::web

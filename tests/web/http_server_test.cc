// HttpServer over real sockets: the token in each of its three places and refused without it or
// with a wrong one, 404 and 405, HEAD without a body, bad addresses refused with the address
// named, and a bounded loop of malformed requests after which the server still answers.
#include "web/http_server.h"

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/web/http_client.h"

namespace strata::web {
namespace {

using strata::testing::HttpExchange;
using strata::testing::HttpGet;

const std::string kToken = "0123456789abcdef0123456789abcdef";

std::unique_ptr<HttpServer> Serve(std::atomic<int>* calls) {
  HttpOptions o;
  o.token = kToken;
  auto server = HttpServer::Start(o, {{"/hello", [calls](const HttpRequest& r) {
                                         ++*calls;
                                         HttpResponse out;
                                         out.body =
                                             absl::StrCat("hello ", r.method, " ",
                                                          r.args.count("x") ? r.args.at("x") : "-");
                                         return out;
                                       }}});
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? *std::move(server) : nullptr;
}

TEST(HttpServerTest, EveryRequestCarriesTheTokenInOneOfItsThreePlaces) {
  std::atomic<int> calls{0};
  auto server = Serve(&calls);
  ASSERT_NE(server, nullptr);
  ASSERT_GT(server->port(), 0);
  EXPECT_EQ(server->base_url(), absl::StrCat("http://127.0.0.1:", server->port()));
  const int port = server->port();

  auto none = HttpGet(port, "/hello");
  EXPECT_EQ(none.status, 401) << none.head;
  EXPECT_NE(none.head.find("WWW-Authenticate: Bearer"), std::string::npos) << none.head;
  EXPECT_NE(none.body.find("the job token is required"), std::string::npos) << none.body;
  for (const std::string& wrong : {kToken.substr(1), kToken + "0", std::string(32, '0')}) {
    auto r = HttpGet(port, "/hello", "Authorization: Bearer " + wrong + "\r\n");
    EXPECT_EQ(r.status, 401) << wrong;
    EXPECT_EQ(r.body, "wrong job token\n");
  }
  EXPECT_EQ(HttpGet(port, "/hello?token=" + kToken.substr(0, 31)).status, 401);
  EXPECT_EQ(calls.load(), 0) << "a refused request reached the handler";

  auto bearer = HttpGet(port, "/hello?x=a%20b", "Authorization: Bearer " + kToken + "\r\n");
  EXPECT_EQ(bearer.status, 200);
  EXPECT_EQ(bearer.body, "hello GET a b") << "the query's value, decoded";
  EXPECT_EQ(HttpGet(port, "/hello", "X-Strata-Token: " + kToken + "\r\n").body, "hello GET -");
  EXPECT_EQ(HttpGet(port, "/hello?token=" + kToken + "&x=1").body, "hello GET 1");
  EXPECT_EQ(calls.load(), 3);

  auto missing = HttpGet(port, "/nothing?token=" + kToken);
  EXPECT_EQ(missing.status, 404);
  auto post = HttpExchange(port, "POST /hello?token=" + kToken +
                                     " HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: "
                                     "close\r\n\r\nhi");
  EXPECT_EQ(post.status, 405) << post.head;
  EXPECT_NE(post.head.find("Allow: GET, HEAD"), std::string::npos) << post.head;
  EXPECT_EQ(HttpGet(port, "/hello", "Authorization: bearer " + kToken + "\r\n").status, 200)
      << "the scheme's case does not matter";
  auto head = HttpExchange(
      port, "HEAD /hello?token=" + kToken + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.body, "") << "HEAD answers without a body";
}

TEST(HttpServerTest, MalformedRequestsDoNotStopTheServer) {
  std::atomic<int> calls{0};
  auto server = Serve(&calls);
  ASSERT_NE(server, nullptr);
  const int port = server->port();
  std::mt19937 rng(2026);
  const std::vector<std::string> fixed = {
      "",
      "\r\n\r\n",
      "GET\r\n\r\n",
      "GET /hello\r\n\r\n",
      "GET /hello HTTP/9.9\r\n\r\n",
      "BREW /hello HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
      "GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
      "GET /hello HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
      "GET /hello HTTP/1.1\r\n" + std::string(100000, 'A') + "\r\n\r\n",
      "GET /" + std::string(70000, 'x') + " HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /hello?token=%zz%0 HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /hello HTTP/1.1\r\nAuthorization: Bearer\r\nHost: x\r\n\r\n",
      "GET /hello HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
      std::string("GET /hello\0 HTTP/1.1\r\nHost: x\r\n\r\n", 34),
  };
  int answered = 0;
  for (int i = 0; i < 200; ++i) {
    std::string raw;
    if (i < static_cast<int>(fixed.size())) {
      raw = fixed[static_cast<size_t>(i)];
    } else {
      // Random bytes, or a valid request cut or with bytes flipped.
      std::string valid = "GET /hello?token=" + kToken + " HTTP/1.1\r\nHost: x\r\n\r\n";
      if (i % 2 == 0) {
        raw.resize(rng() % 300);
        for (char& c : raw) c = static_cast<char>(rng() % 256);
      } else {
        raw = valid.substr(0, rng() % valid.size());
        for (int k = 0; k < 3 && !raw.empty(); ++k)
          raw[rng() % raw.size()] = static_cast<char>(rng());
      }
    }
    auto r = HttpExchange(port, raw, 5);
    if (r.status != 0) ++answered;
    EXPECT_NE(r.status, 200) << "malformed request " << i << " was answered 200";
  }
  EXPECT_GT(answered, 0) << "no malformed request got an error status";
  auto ok = HttpGet(port, "/hello?token=" + kToken);
  EXPECT_EQ(ok.status, 200) << "the server stopped serving after malformed requests";
  EXPECT_EQ(ok.body, "hello GET -");
}

TEST(HttpServerTest, BadAddressesAreRefusedWithTheAddressNamed) {
  for (const std::string& address :
       {std::string("8080"), std::string(":8080"), std::string("127.0.0.1:99999"),
        std::string("127.0.0.1:x"), std::string("no.such.host:80"), std::string("[::1]:80")}) {
    HttpOptions o;
    o.address = address;
    auto s = HttpServer::Start(o, {});
    ASSERT_FALSE(s.ok()) << address;
    EXPECT_NE(s.status().message().find("'" + address + "' is not HOST:PORT"), std::string::npos)
        << s.status();
  }
  // A port in use: the second server says which address it could not take.
  auto first = HttpServer::Start(HttpOptions{}, {});
  ASSERT_TRUE(first.ok()) << first.status();
  HttpOptions taken;
  taken.address = absl::StrCat("127.0.0.1:", (*first)->port());
  auto second = HttpServer::Start(taken, {});
  ASSERT_FALSE(second.ok());
  EXPECT_NE(second.status().message().find("cannot serve HTTP on " + taken.address),
            std::string::npos)
      << second.status();
  // A certificate that is not there.
  HttpOptions tls;
  tls.tls_cert = "/nonexistent/cert.pem";
  tls.tls_key = "/nonexistent/key.pem";
  auto no_cert = HttpServer::Start(tls, {});
  ASSERT_FALSE(no_cert.ok());
  EXPECT_NE(no_cert.status().message().find(HttpServer::SupportsTls() ? "/nonexistent/cert.pem"
                                                                      : "has no TLS"),
            std::string::npos)
      << no_cert.status();
}

}  // namespace
}  // namespace strata::web

// A minimal HTTP/1.1 client over a raw TCP socket, for the tests of strata's HTTP endpoint: it
// sends exactly the bytes it is given (so tests can send malformed requests) and reads the answer
// until the server closes the connection.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace strata::testing {

struct HttpAnswer {
  int status = 0;  // 0: no status line came back
  std::string head, body;
};

// Sends `raw` to 127.0.0.1:port and reads until the server closes (or `timeout_s` passes).
inline HttpAnswer HttpExchange(int port, const std::string& raw, int timeout_s = 10) {
  HttpAnswer a;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return a;
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return a;
  }
  for (size_t sent = 0; sent < raw.size();) {
    const ssize_t n = send(fd, raw.data() + sent, raw.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  std::string all;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) all.append(buf, static_cast<size_t>(n));
  close(fd);
  const size_t end = all.find("\r\n\r\n");
  a.head = all.substr(0, end);
  a.body = end == std::string::npos ? "" : all.substr(end + 4);
  if (all.rfind("HTTP/1.", 0) == 0 && all.size() > 12) {
    int status = 0;
    if (absl::SimpleAtoi(all.substr(9, 3), &status)) a.status = status;
  }
  return a;
}

// GET `target` (path and query) with extra header lines (each ending in \r\n).
inline HttpAnswer HttpGet(int port, const std::string& target, const std::string& headers = "") {
  return HttpExchange(port, absl::StrCat("GET ", target, " HTTP/1.1\r\nHost: 127.0.0.1\r\n",
                                         headers, "Connection: close\r\n\r\n"));
}

}  // namespace strata::testing

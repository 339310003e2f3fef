// File: tests/metrics_scrape.h
// -----------------------------------------------------------------------------
// What end-to-end tests read of a live process's /metrics: one plain HTTP/1.0 GET on loopback.
//
// Example:
//   const std::string text = ScrapeMetrics(metrics_port);  // Prometheus text, "" if unreadable
//
// Failure model: any failure (no listener, a cut answer) gives "". Thread safety: thread-safe.
#ifndef BERTSHARD_TESTS_METRICS_SCRAPE_H_
#define BERTSHARD_TESTS_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace bertshard::testing {

// The body of `GET /metrics` on 127.0.0.1:`port`; "" if it cannot be read.
inline std::string ScrapeMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof buffer)) > 0;) response.append(buffer, static_cast<size_t>(n));
    }
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

}  // namespace bertshard::testing

#endif  // BERTSHARD_TESTS_METRICS_SCRAPE_H_

// Workers of one generation as threads of the test process, each with its own real Gloo
// communicator over an in-memory store.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include "runtime/comm/communicator.h"
#include "runtime/comm/store.h"

namespace strata::testing {

// Runs fn(comm, rank) on W threads, each with its own Gloo communicator (timeout `timeout`), and
// joins them.
inline void RunGlooWorkers(int W, std::chrono::milliseconds timeout,
                           const std::function<void(comm::Communicator*, int)>& fn) {
  std::shared_ptr<comm::Store> store = comm::MakeInMemoryStore();
  std::vector<std::thread> threads;
  for (int r = 0; r < W; ++r) {
    threads.emplace_back([&, r] {
      comm::CommOptions co;
      co.rank = r;
      co.world_size = W;
      co.timeout = timeout;
      StatusOr<std::unique_ptr<comm::Communicator>> c = comm::ConnectGloo(store, co);
      ASSERT_TRUE(c.ok()) << c.status();
      fn(c->get(), r);
    });
  }
  for (std::thread& t : threads) t.join();
}

}  // namespace strata::testing

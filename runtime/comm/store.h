// Store: the key-value rendezvous that workers of one membership generation meet through.
//
// Communicators exchange their addresses through it (and NCCL its unique id); nothing else uses
// it (the trainer's barrier before the first step runs on a communicator). Keys are strings,
// values bytes. Every generation of a membership works under its own prefix (PrefixStore with
// "gen/<g>/"), so a worker of the new generation never reads a key a dead worker left behind.
//
//   InMemoryStore  threads of one process (tests, single-process jobs)
//   FileStore      processes that share a folder (one machine, or a shared file system); a key
//                  is a file written to a temporary name and renamed into place, so readers never
//                  see half a value; Add is serialised with flock
// Behind the same interface, the coordinator's store serves workers over gRPC
// (coordinator/service.h, CoordinatorClient::store) and in its own process
// (coordinator/state.h, MakeCoordinatorStore).
//
// Every Store is safe for concurrent use by multiple threads (a FileStore also by several
// processes), and is shared as a std::shared_ptr: prefix and cancellable stores keep their base
// alive. Values are returned as copies.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/common/status.h"

namespace strata::comm {

class Store {
 public:
  virtual ~Store() = default;
  // Sets (or replaces) a key.
  [[nodiscard]] virtual Status Set(const std::string& key, const std::string& value) = 0;
  // The value of a key; NOT_FOUND when it is not set.
  [[nodiscard]] virtual StatusOr<std::string> Get(const std::string& key) = 0;
  // Waits until every key is set; DEADLINE_EXCEEDED naming the keys still missing after
  // `timeout`.
  [[nodiscard]] virtual Status Wait(const std::vector<std::string>& keys,
                                    std::chrono::milliseconds timeout) = 0;
  // Adds `delta` to the decimal integer stored at `key` (absent: 0), atomically across every
  // user of the store, and returns the new value.
  [[nodiscard]] virtual StatusOr<int64_t> Add(const std::string& key, int64_t delta) = 0;

  // Waits for a key and returns its value.
  [[nodiscard]] StatusOr<std::string> WaitGet(const std::string& key,
                                              std::chrono::milliseconds timeout);
};

std::shared_ptr<Store> MakeInMemoryStore();

// Creates `dir` if needed. Keys may contain any character; they are escaped into file names.
[[nodiscard]] StatusOr<std::shared_ptr<Store>> MakeFileStore(const std::string& dir);

// Every key of `base` under `prefix` (e.g. "gen/3/").
std::shared_ptr<Store> MakePrefixStore(std::shared_ptr<Store> base, std::string prefix);

// Waits of `base` give up with ABORTED (saying `why`) as soon as `cancelled()` holds, checked
// every 100 ms: a rendezvous that a newer membership generation made pointless ends at once
// instead of at its timeout. `cancelled` runs on each waiting thread, possibly several at once, and
// lives as long as the store.
std::shared_ptr<Store> MakeCancellableStore(std::shared_ptr<Store> base,
                                            std::function<bool()> cancelled, std::string why);

// The prefix of a membership generation: "gen/<g>/".
std::string GenerationPrefix(int64_t generation);

}  // namespace strata::comm

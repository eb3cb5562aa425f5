#include "runtime/comm/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace strata::comm {
namespace {

using Clock = std::chrono::steady_clock;

Status MissingKeys(const std::vector<std::string>& keys, std::chrono::milliseconds timeout,
                   const std::string& where) {
  return absl::DeadlineExceededError(absl::StrFormat(
      "store %s: key(s) %s not set within %d ms; a peer has not reached this point (is every "
      "worker of this generation running? raise the timeout if they start slowly)",
      where, absl::StrJoin(keys, ", "), timeout.count()));
}

StatusOr<int64_t> ParseCounter(const std::string& key, const std::string& value) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  if (ec != std::errc() || end != value.data() + value.size()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "store key '%s' holds '%s', not an integer: Add is only for counters", key, value));
  }
  return v;
}

class InMemoryStore : public Store {
 public:
  Status Set(const std::string& key, const std::string& value) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[key] = value;
    }
    cv_.notify_all();
    return absl::OkStatus();
  }
  StatusOr<std::string> Get(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return absl::NotFoundError(absl::StrCat("store key '", key, "' not set"));
    return it->second;
  }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto missing = [&] {
      std::vector<std::string> m;
      for (const auto& k : keys) {
        if (!map_.count(k)) m.push_back(k);
      }
      return m;
    };
    if (cv_.wait_for(lock, timeout, [&] { return missing().empty(); })) return absl::OkStatus();
    return MissingKeys(missing(), timeout, "(in memory)");
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    int64_t v = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(key);
      if (it != map_.end()) {
        ASSIGN_OR_RETURN(v, ParseCounter(key, it->second));
      }
      v += delta;
      map_[key] = std::to_string(v);
    }
    cv_.notify_all();
    return v;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

// A key as a file name: [A-Za-z0-9._-] kept, every other byte as %XX.
std::string Escape(const std::string& key) {
  std::string out;
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      out.push_back(static_cast<char>(c));
    } else {
      out += absl::StrFormat("%%%02X", c);
    }
  }
  if (out.empty() || out[0] == '.') out = "%" + out;  // never "", "." or a hidden file
  return out;
}

class FileStore : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}

  Status Set(const std::string& key, const std::string& value) override {
    return WriteAtomically(Path(key), value);
  }
  StatusOr<std::string> Get(const std::string& key) override {
    std::ifstream f(Path(key), std::ios::binary);
    if (!f) return absl::NotFoundError(absl::StrCat("store key '", key, "' not set in ", dir_));
    std::ostringstream s;
    s << f.rdbuf();
    return s.str();
  }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    auto sleep = std::chrono::milliseconds(1);
    while (true) {
      std::vector<std::string> missing;
      for (const auto& k : keys) {
        if (!std::filesystem::exists(Path(k))) missing.push_back(k);
      }
      if (missing.empty()) return absl::OkStatus();
      if (Clock::now() >= deadline) return MissingKeys(missing, timeout, dir_);
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::milliseconds(20));
    }
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    const std::string lock_path = dir_ + "/.lock";
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
      return absl::InternalError(
          absl::StrFormat("store: cannot open %s: %s", lock_path, std::strerror(errno)));
    }
    if (::flock(fd, LOCK_EX) != 0) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(
          absl::StrFormat("store: cannot lock %s: %s", lock_path, std::strerror(err)));
    }
    StatusOr<int64_t> result = [&]() -> StatusOr<int64_t> {
      int64_t v = 0;
      auto cur = Get(key);
      if (cur.ok()) {
        ASSIGN_OR_RETURN(v, ParseCounter(key, *cur));
      }
      v += delta;
      RETURN_IF_ERROR(WriteAtomically(Path(key), std::to_string(v)));
      return v;
    }();
    ::flock(fd, LOCK_UN);
    ::close(fd);
    return result;
  }

 private:
  std::string Path(const std::string& key) const { return dir_ + "/" + Escape(key); }

  Status WriteAtomically(const std::string& path, const std::string& value) {
    const std::string tmp =
        absl::StrCat(dir_, "/.tmp.", ::getpid(), ".",
                     std::hash<std::thread::id>()(std::this_thread::get_id()), ".", counter_++);
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(value.data(), static_cast<std::streamsize>(value.size()));
      f.flush();
      if (!f) {
        std::filesystem::remove(tmp);
        return absl::InternalError(absl::StrFormat(
            "store: cannot write %s (is the store folder writable and the disk not full?)", tmp));
      }
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) {
      std::filesystem::remove(tmp);
      return absl::InternalError(
          absl::StrFormat("store: cannot rename %s to %s: %s", tmp, path, ec.message()));
    }
    return absl::OkStatus();
  }

  std::string dir_;
  std::atomic<uint64_t> counter_{0};
};

class PrefixStore : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, std::string prefix)
      : base_(std::move(base)), prefix_(std::move(prefix)) {}
  Status Set(const std::string& key, const std::string& value) override {
    return base_->Set(prefix_ + key, value);
  }
  StatusOr<std::string> Get(const std::string& key) override { return base_->Get(prefix_ + key); }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    return base_->Wait(full, timeout);
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    return base_->Add(prefix_ + key, delta);
  }

 private:
  std::shared_ptr<Store> base_;
  std::string prefix_;
};

class CancellableStore : public Store {
 public:
  CancellableStore(std::shared_ptr<Store> base, std::function<bool()> cancelled, std::string why)
      : base_(std::move(base)), cancelled_(std::move(cancelled)), why_(std::move(why)) {}
  Status Set(const std::string& key, const std::string& value) override {
    return base_->Set(key, value);
  }
  StatusOr<std::string> Get(const std::string& key) override { return base_->Get(key); }
  Status Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    constexpr std::chrono::milliseconds kSlice(100);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      Status s = base_->Wait(keys, std::max(std::chrono::milliseconds(0), std::min(left, kSlice)));
      if (s.ok() || s.code() != absl::StatusCode::kDeadlineExceeded || left <= kSlice) return s;
      if (cancelled_()) return absl::AbortedError(why_);
    }
  }
  StatusOr<int64_t> Add(const std::string& key, int64_t delta) override {
    return base_->Add(key, delta);
  }

 private:
  std::shared_ptr<Store> base_;
  std::function<bool()> cancelled_;
  std::string why_;
};

}  // namespace

StatusOr<std::string> Store::WaitGet(const std::string& key, std::chrono::milliseconds timeout) {
  RETURN_IF_ERROR(Wait({key}, timeout));
  return Get(key);
}

std::shared_ptr<Store> MakeInMemoryStore() { return std::make_shared<InMemoryStore>(); }

StatusOr<std::shared_ptr<Store>> MakeFileStore(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "store folder '%s' cannot be created (%s); pass a writable folder to --store", dir,
        ec ? ec.message() : "not a folder"));
  }
  return std::shared_ptr<Store>(std::make_shared<FileStore>(dir));
}

std::shared_ptr<Store> MakePrefixStore(std::shared_ptr<Store> base, std::string prefix) {
  return std::make_shared<PrefixStore>(std::move(base), std::move(prefix));
}

std::shared_ptr<Store> MakeCancellableStore(std::shared_ptr<Store> base,
                                            std::function<bool()> cancelled, std::string why) {
  return std::make_shared<CancellableStore>(std::move(base), std::move(cancelled), std::move(why));
}

std::string GenerationPrefix(int64_t generation) { return absl::StrCat("gen/", generation, "/"); }

}  // namespace strata::comm

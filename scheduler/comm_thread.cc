#include "scheduler/comm_thread.h"

#include <utility>

namespace strata::scheduler {

CommThread::CommThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { Loop(); });
}

CommThread::~CommThread() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return finished_ == submitted_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

CommThread::Ticket CommThread::Submit(std::function<Status()> op, std::string label) {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(op), std::move(label));
    t = ++submitted_;
  }
  cv_.notify_one();
  return t;
}

Status CommThread::Wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return finished_ >= ticket; });
  return status_;
}

Status CommThread::Drain() {
  Ticket t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = submitted_;
  }
  return Wait(t);
}

Status CommThread::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

double CommThread::TakeBusySeconds() {
  std::lock_guard<std::mutex> lock(mu_);
  const double b = busy_;
  busy_ = 0;
  return b;
}

void CommThread::Loop() {
  for (;;) {
    std::function<Status()> op;
    std::string label;
    bool skip;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front().first);
      label = std::move(queue_.front().second);
      queue_.pop_front();
      skip = !status_.ok();
    }
    Status s;
    const double t0 = NowSeconds();
    if (!skip) s = op();
    const double t1 = NowSeconds(), spent = t1 - t0;
    if (Tracer* tracer = tracer_.load(); tracer != nullptr && !skip) {
      if (!named_) {
        tracer->NameThisThread("comm: " + name_);
        named_ = true;
      }
      tracer->Span(std::move(label), "comm", t0, t1);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (status_.ok() && !s.ok()) status_ = s;
      busy_ += spent;
      ++finished_;
    }
    done_cv_.notify_all();
  }
}

}  // namespace strata::scheduler

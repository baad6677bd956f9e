// A fixed pool of threads running tasks in FIFO order: the engine's copy, checksum and parser threads.
#pragma once

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common.hpp"

namespace ds {

class TaskPool {
 public:
  // `name`: each thread's, as name_this_thread takes it; `nice`: steps below the creator's priority
  // (lower_this_thread). Returns once every thread carries both.
  TaskPool(unsigned threads, const char* name, int nice = 0) : started_(threads) {
    for (unsigned i = 0; i < threads; ++i)
      threads_.emplace_back([this, name, nice] {
        name_this_thread(name);
        lower_this_thread(nice);
        started_.arrive();
        run();
      });
    started_.wait();
  }
  ~TaskPool() { stop(); }
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  // Runs what is queued (and what those tasks queue), then joins. Idempotent.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  unsigned size() const { return static_cast<unsigned>(threads_.size()); }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        task();
      } catch (const std::exception& e) {  // tasks store their errors; this is a last line of defence
        std::fprintf(stderr, "nanotron_datastates: task failed: %s\n", e.what());
      } catch (...) {
        std::fprintf(stderr, "nanotron_datastates: task failed\n");
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  StartLatch started_;
  std::vector<std::thread> threads_;
};

}  // namespace ds

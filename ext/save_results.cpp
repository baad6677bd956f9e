// A save's waits and results, as the bindings read them: snapshot and persisted flags, the first error, the
// checksums and the file's figures.
#include <algorithm>
#include <chrono>

#include "save_job.hpp"

namespace ds {
namespace {

bool wait_flag(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, const bool& flag,
               double timeout_s) {
  if (timeout_s < 0) {
    cv.wait(lock, [&] { return flag; });
    return true;
  }
  return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return flag; });
}

}  // namespace

// -- waits and results (the bindings' side) -----------------------------------------------------------------

bool SaveJob::wait_snapshot(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return wait_flag(cv_, lock, snapshot_, timeout_s);
}

bool SaveJob::wait_persisted(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return wait_flag(cv_, lock, persisted_, timeout_s);
}

bool SaveJob::snapshot_done() {
  std::lock_guard<std::mutex> lock(mu_);
  return snapshot_;
}

bool SaveJob::persisted_done() {
  std::lock_guard<std::mutex> lock(mu_);
  return persisted_;
}

Error SaveJob::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::vector<std::pair<std::string, std::uint32_t>> SaveJob::checksums() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<std::string, std::uint32_t>> out;
  if (!persisted_ || error_ || crcs_.size() != layout_.order.size()) return out;
  out.reserve(crcs_.size());
  for (std::size_t k = 0; k < crcs_.size(); ++k) out.emplace_back(tensors_[layout_.order[k]].name, crcs_[k]);
  return out;
}

std::pair<std::size_t, std::vector<std::pair<std::string, std::vector<std::uint32_t>>>>
SaveJob::block_checksums() {
  std::lock_guard<std::mutex> lock(mu_);
  std::pair<std::size_t, std::vector<std::pair<std::string, std::vector<std::uint32_t>>>> out{0, {}};
  if (!persisted_ || error_ || crcs_.size() != layout_.order.size()) return out;
  out.first = block_;
  out.second.reserve(crcs_.size());
  for (std::size_t k = 0; k < crcs_.size(); ++k)
    out.second.emplace_back(tensors_[layout_.order[k]].name, crc_parts_[k]);
  return out;
}

JobStats SaveJob::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool wait_jobs(const std::vector<SaveJob*>& jobs, bool persisted, double timeout_s) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                           std::chrono::duration<double>(std::max(timeout_s, 0.0)));
  for (SaveJob* job : jobs) {
    double left = -1.0;
    if (timeout_s >= 0) left = std::max(0.0, std::chrono::duration<double>(deadline - clock::now()).count());
    if (!(persisted ? job->wait_persisted(left) : job->wait_snapshot(left))) return false;
  }
  return true;
}

}  // namespace ds

// Fault injection in the flush layer, for tests: armed from Python (`_core._arm_fault`), it fails the next
// matching write, fsync or read with a chosen errno instead of doing it, so that EIO and friends can be
// tested on a healthy disk. Compiled into every build: disarmed, it costs one relaxed atomic load per op.
#pragma once

#include <string>

#include "flush.hpp"

namespace ds::fault {

// `kind`: "write", "fsync", "read" or "any". Ops on files whose path contains `path_contains` are counted:
// the first `skip` pass, the next `count` fail with `err`; then the fault disarms itself.
void arm(const std::string& kind, int err, const std::string& path_contains, int skip, int count);
void disarm();
// Ops failed since the last arm().
int hits();

// 0, or the errno `op` must fail with.
int check(const IoOp& op);

}  // namespace ds::fault

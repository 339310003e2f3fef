// File: common/fault_point.h
// -----------------------------------------------------------------------------
// Pause points for fault-injection tests: a way for a test to stop a process at an exact phase
// (loading, joining the process groups, a forward, an unload) and then kill, stop or release it,
// instead of sleeping and hoping the phase is under way.
//
// A process that reaches PausePoint("load") does nothing unless $BERTSHARD_FAULT_DIR names a
// directory holding a file "load.hold". Then it creates "load.<pid>.reached" in that directory
// (the test learns which process got there, and when) and waits until "load.hold" is gone. Without
// the variable a call is one cached getenv; production never sets it.
//
// Thread safety: thread-safe; several threads may wait at the same point, but the marker names
// the process only: a test counts processes that got there, not threads.
#ifndef BERTSHARD_COMMON_FAULT_POINT_H_
#define BERTSHARD_COMMON_FAULT_POINT_H_

#include <string_view>

namespace bertshard::common {

// Blocks while $BERTSHARD_FAULT_DIR/<name>.hold exists, after announcing the arrival (see above).
// `name`: letters, digits and '_' only (it becomes a file name).
void PausePoint(std::string_view name);

}  // namespace bertshard::common

#endif  // BERTSHARD_COMMON_FAULT_POINT_H_

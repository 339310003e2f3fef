// File: common/status_macros.h
// -----------------------------------------------------------------------------
// RETURN_IF_ERROR and ASSIGN_OR_RETURN for absl::Status / absl::StatusOr. The abseil in Debian 12
// (20220623) has neither; newer abseil's ABSL_RETURN_IF_ERROR / ABSL_ASSIGN_OR_RETURN follow the
// same rules, so these can become aliases later.
//
// Example:
//   absl::StatusOr<Plan> Build(const Request& r) {
//     RETURN_IF_ERROR(Validate(r));
//     ASSIGN_OR_RETURN(Layout layout, ComputeLayout(r));
//     return Plan(layout);
//   }
//
// Rules (as abseil's): each macro is one or more statements, so use braces around it in an
// unbraced `if`; a left-hand side must not contain a bare comma (use a type alias or `auto`);
// lambdas that use them need an explicit `-> absl::Status` return type. The argument is
// evaluated exactly once.
//
// Thread safety: macros only; no state.
#ifndef BERTSHARD_COMMON_STATUS_MACROS_H_
#define BERTSHARD_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define BERTSHARD_STATUS_CONCAT_INNER_(a, b) a##b
#define BERTSHARD_STATUS_CONCAT_(a, b) BERTSHARD_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define RETURN_IF_ERROR(expr)                              \
  do {                                                     \
    ::absl::Status bertshard_status_ = (expr);             \
    if (!bertshard_status_.ok()) return bertshard_status_; \
  } while (false)

#define BERTSHARD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                     \
  if (!statusor.ok()) return std::move(statusor).status();     \
  lhs = std::move(statusor).value()

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else assigns or
// declares `lhs` with the value.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  BERTSHARD_ASSIGN_OR_RETURN_IMPL_(BERTSHARD_STATUS_CONCAT_(bertshard_statusor_, __LINE__), lhs, rexpr)

#endif  // BERTSHARD_COMMON_STATUS_MACROS_H_

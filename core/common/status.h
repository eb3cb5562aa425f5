// Errors are values: every fallible call across a module boundary returns absl::Status or
// absl::StatusOr<T>. The codes are gRPC's, so the coordinator forwards them without translation.
// A message says what was wrong, where (file, field, line, rank) and what to do about it.
// Aliases and macros only: nothing here holds state.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace strata {

using absl::Status;
using absl::StatusOr;

}  // namespace strata

#define STRATA_CONCAT_IMPL_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_IMPL_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status strata_status_ = (expr);          \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, Foo());` declares/assigns x from a StatusOr, or returns its error.
#define ASSIGN_OR_RETURN(lhs, rexpr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_statusor_, __LINE__), lhs, rexpr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = *std::move(statusor)

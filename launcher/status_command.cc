#include "launcher/commands.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "coordinator/service.h"
#include "launcher/command_util.h"

namespace strata::launcher {
int StatusCommand(const std::vector<std::string>& args) {
  static const std::vector<FlagSpec> specs = {
      {"token-file", "file holding the job token (default: $STRATA_JOB_TOKEN)"},
      {"token", "the job token (visible in `ps`: prefer --token-file or $STRATA_JOB_TOKEN)"},
      {"tls-ca", "PEM CA certificate: reach a coordinator that serves TLS"},
  };
  if (args.empty() || WantsHelp(args)) {
    std::fprintf(args.empty() ? stderr : stdout,
                 "usage: strata status HOST:PORT [--token-file F] [--tls-ca FILE]\n");
    return args.empty() ? 2 : 0;
  }
  auto flags = Flags::Parse("status", specs, {args.begin() + 1, args.end()});
  if (!flags.ok()) return UsageError(flags.status(), "status", specs);
  auto token = TokenFrom(*flags);
  if (!token.ok()) return Fail(token.status());
  auto client = coordinator::CoordinatorClient::Connect(args[0], *token,
                                                        flags->String("tls-ca").value_or(""));
  if (!client.ok()) return Fail(client.status());
  auto r = (*client)->GetStatus();
  if (!r.ok()) return Fail(r.status());
  const auto& g = r->generation();
  std::printf("generation %lld (%s) since step %lld; step %lld done\n",
              static_cast<long long>(g.number()), g.reason().c_str(),
              static_cast<long long>(g.first_step()), static_cast<long long>(r->step()));
  for (int i = 0; i < g.workers_size(); ++i) {
    std::printf("  rank %d  %s  %s\n", i, g.workers(i).id().c_str(), g.workers(i).host().c_str());
  }
  for (const auto& w : r->pending()) {
    std::printf("  pending  %s  %s\n", w.id().c_str(), w.host().c_str());
  }
  if (r->finished()) std::printf("the job finished\n");
  if (r->tokens_per_s() > 0) std::printf("throughput %.0f tokens/s\n", r->tokens_per_s());
  if (r->moe_balance_size() > 0) {
    std::printf("load balance at step %lld (rank 0's report):\n",
                static_cast<long long>(r->moe_balance_step()));
  }
  for (const auto& layer : r->moe_balance()) {
    std::printf("  %s\n", coordinator::MoeBalanceLine(layer).c_str());
  }
  if (r->experts_per_worker_size() > 0) {
    std::printf("experts per rank: %s\n", absl::StrJoin(r->experts_per_worker(), " ").c_str());
  }
  // The catalog: what exists (checked against the checkpoint folder) and what does not yet.
  if (r->catalog_size() > 0) std::printf("checkpoints:\n");
  for (const auto& c : r->catalog()) {
    std::string what;
    if (c.complete() && c.sequence() > 0) {
      constexpr int kNamed = 8;
      std::vector<std::string> names(c.shards().begin(),
                                     c.shards().begin() + std::min(c.shards_size(), kNamed));
      if (c.shards_size() > kNamed)
        names.push_back(absl::StrFormat("+%d", c.shards_size() - kNamed));
      what = absl::StrFormat("complete, %d shard%s (%s)", c.shards_size(),
                             c.shards_size() == 1 ? "" : "s", absl::StrJoin(names, " "));
    } else if (c.complete()) {
      what = "complete as rank 0 reported (the checkpoint folder does not show it)";
    } else {
      what = absl::StrFormat("not complete: prepared in generation %d, no global manifest yet",
                             c.generation());
    }
    std::printf("  %lld  %s\n", static_cast<long long>(c.step()), what.c_str());
  }
  if (!r->catalog_error().empty())
    std::printf("checkpoint folder: %s\n", r->catalog_error().c_str());
  return 0;
}

}  // namespace strata::launcher

#include "client/cli/plan_command.h"

#include <iostream>
#include <memory>

#include "client/cli/exit_codes.h"
#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/report.h"

namespace shardcast::cli {

namespace {

struct PlanArgs {
  std::string src, dst;
  bool json = false;
  planner::CostModel model;
  double chunk_mib = 64, bucket_mib = 16, small_kib = 1024;
  int max_chain = 16;
  std::string strategy = "planned";
};

int runPlan(const PlanArgs& a) {
  using namespace shardcast::planner;
  NodeTable nodes;
  auto fail = [](const Status& st) {
    std::cerr << "shardcast plan: " << st.message() << "\n";
    return absl::IsNotFound(st) || absl::IsInvalidArgument(st) || absl::IsFailedPrecondition(st) ? kInvalidInput
                                                                                                 : kInternal;
  };
  auto src_json = readLayoutFile(a.src);
  if (!src_json.ok()) return fail(src_json.status());
  auto dst_json = readLayoutFile(a.dst);
  if (!dst_json.ok()) return fail(dst_json.status());
  auto src = resolveLayout(*src_json, nodes);
  if (!src.ok()) return fail(Status(src.status().code(), a.src + ": " + std::string(src.status().message())));
  auto dst = resolveLayout(*dst_json, nodes);
  if (!dst.ok()) return fail(Status(dst.status().code(), a.dst + ": " + std::string(dst.status().message())));
  if (auto st = addScaleSources(*src, *dst); !st.ok()) return fail(st);
  PlanOptions opts;
  opts.chunk_bytes = static_cast<int64_t>(a.chunk_mib * (1 << 20));
  opts.bucket_bytes = static_cast<int64_t>(a.bucket_mib * (1 << 20));
  opts.small_bytes = static_cast<int64_t>(a.small_kib * 1024);
  opts.max_chain = a.max_chain;
  opts.strategy = a.strategy == "rank-pull"          ? Strategy::kRankPull
                  : a.strategy == "gather-broadcast" ? Strategy::kGatherBroadcast
                                                     : Strategy::kPlanned;
  auto plan = makePlan(*src, *dst, nodes, opts);
  if (!plan.ok()) return fail(plan.status());
  if (a.json)
    std::cout << renderJson(*plan, nodes, a.model) << "\n";
  else
    std::cout << renderText(*plan, nodes, a.model, src->group, dst->group);
  return kOk;
}

}  // namespace

void addPlanCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Plan a sync between two layout files and print its summary");
  cmd->add_option("--src", args->src, "Source layout (JSON form of shardcast.v1.Layout)")->required();
  cmd->add_option("--dst", args->dst, "Destination layout")->required();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of the summary");
  cmd->add_option("--nic-gbps", args->model.nic_gbps, "NIC bandwidth per node, Gbit/s")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--local-gbps", args->model.local_gbps, "Node-local copy bandwidth, Gbit/s")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--chunk-mib", args->chunk_mib, "Chunk size of large transfers, MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--bucket-mib", args->bucket_mib, "Bucket size for small tensors, MiB")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--small-kib", args->small_kib, "Fragments below this size travel in buckets, KiB")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-chain", args->max_chain, "Destination nodes per relay chain")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--strategy", args->strategy,
                  "planned: Shardcast's plan; rank-pull, gather-broadcast: the baselines a sync can run instead "
                  "(shardcast sync --strategy)")
      ->check(CLI::IsMember({"planned", "rank-pull", "gather-broadcast"}))
      ->capture_default_str();
  cmd->callback([args, exit_code] { *exit_code = runPlan(*args); });
}

}  // namespace shardcast::cli

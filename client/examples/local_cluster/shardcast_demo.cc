// The README's main job: a small Shardcast cluster on this machine. Starts one shardcastd per
// node (2 trainer nodes, 3 inference nodes by default), puts a Llama-like model's weights into
// shared memory in the trainer layout (FSDP over 8 ranks), registers inference ranks in another
// layout (vLLM-like TP=4 per node, fused qkv / gate_up), syncs it several versions in a row,
// verifies every destination byte after each sync, and prints the plan and the throughput.
//
//   build/bin/shardcast-demo [--layers 4] [--hidden 1024] [--syncs 3] [--trainer-nodes 2]
//                            [--inference-nodes 3] [--ucx-tls TLS] [--staging-mib N] [--chunk-mib N] [--window-mib N]
//                            [--verify] [--daemon-arg ARG]... [--netns] [--nic-gbps G] [--report] [--vocab N]
//                            [--experts E] [--strategies planned,rank-pull,gather-broadcast]
// --experts makes every layer's MLP a mixture of E experts (stacked w13 [E, 2h, h] and w2
// [E, h, h], a router [E, h]): whole experts per trainer rank, experts split across inference
// nodes (EP) and their intermediate dim across each node's ranks (TP). --strategies runs the syncs
// once per routing, in the same cluster: Shardcast's plan and the baselines (v1::SyncStrategy).
// With --netns each daemon runs in the network namespace "sc-<node>" that bench/cluster.sh made
// (node k of trainer-0.., inference-0.. at 10.77.0.<k+2>): a real, rate-limited network between
// the nodes; ranks still reach their daemon over its Unix socket.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>

#include "client/lib/client.h"
#include "planner/layout.h"
#include "planner/report.h"
#include "tests/support/local_daemon.h"

using namespace shardcast;
using examples::Daemon;

namespace {

struct Options {
  int layers = 4, syncs = 3, trainer_nodes = 2, inference_nodes = 3;
  int64_t hidden = 1024, vocab = 32000;
  std::string tls;
  int64_t staging_mib = 0;  // 0: the daemon's default
  int64_t chunk_mib = 0;
  int64_t window_mib = 0;
  bool verify = false;
  std::vector<std::string> daemon_args;  // passed to every shardcastd as they are
  bool netns = false;                    // daemons in bench/cluster.sh's namespaces
  double nic_gbps = 0;                   // the link rate the plan's prediction is for (0: default)
  bool report = false;                   // RESULT lines for scripts
  bool double_buffered = false;          // inference ranks with a second set of their buffers
  int64_t experts = 0;                   // 0: dense MLPs
  std::vector<std::string> strategies{"planned"};
};

const std::map<std::string, v1::SyncStrategy> kStrategies{{"planned", v1::STRATEGY_PLANNED},
                                                          {"rank-pull", v1::STRATEGY_RANK_PULL},
                                                          {"gather-broadcast", v1::STRATEGY_GATHER_BROADCAST}};

constexpr const char* kUsage =
    "usage: shardcast-demo [--layers 4] [--hidden 1024] [--syncs 3] [--trainer-nodes 2] [--inference-nodes 3]\n"
    "                      [--ucx-tls TLS] [--staging-mib N] [--chunk-mib N] [--window-mib N] [--verify]\n"
    "                      [--daemon-arg ARG]... [--netns] [--nic-gbps G] [--report] [--vocab 32000]\n"
    "                      [--double-buffered]\n"
    "                      [--experts E] [--strategies planned,rank-pull,gather-broadcast]\n"
    "Starts one shardcastd per node on loopback, registers a Llama-like model's ranks in a trainer layout\n"
    "(FSDP) and an inference layout (TP per node, fused qkv/gate_up), syncs --syncs versions, checks every\n"
    "destination byte and prints the plan and the throughput. --daemon-arg passes a flag to every daemon,\n"
    "e.g. --daemon-arg=--ucx-tcp-segment-kib=64 (shardcastd --help lists them). --netns runs each daemon in the\n"
    "network namespace sc-<node> that bench/cluster.sh made; --nic-gbps the plan's prediction is for that link\n"
    "rate; --report prints RESULT lines (plan figures, each sync's seconds) for scripts. --experts E makes every\n"
    "MLP a mixture of E experts (whole experts per trainer rank; EP across inference nodes, TP within).\n"
    "--strategies runs the syncs once per routing in the same cluster: Shardcast's plan and the baselines\n"
    "(rank-pull: every destination rank pulls its own slices; gather-broadcast: all through one node).\n"
    "--double-buffered registers every inference rank with a second set of its buffers (syncs write the set\n"
    "not in use and flip at commit; a repeated sync then folds its Prepare into its first wave).\n";

std::string layoutJson(const Options& o, bool trainer) {
  const int64_t h = o.hidden, inter = h * 11 / 4, kv = h / 4;
  struct T {
    std::string name;
    std::vector<int64_t> shape;
    char kind;  // c column, r row, n replicated (norms, routers), e/f expert-stacked w13/w2
  };
  std::vector<T> ts{{"model.embed_tokens.weight", {o.vocab, h}, 'c'}};
  for (int l = 0; l < o.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    ts.push_back({p + "self_attn.q_proj.weight", {h, h}, 'c'});
    ts.push_back({p + "self_attn.k_proj.weight", {kv, h}, 'c'});
    ts.push_back({p + "self_attn.v_proj.weight", {kv, h}, 'c'});
    ts.push_back({p + "self_attn.o_proj.weight", {h, h}, 'r'});
    if (o.experts > 0) {
      ts.push_back({p + "mlp.gate.weight", {o.experts, h}, 'n'});
      ts.push_back({p + "mlp.experts.w13_weight", {o.experts, 2 * h, h}, 'e'});
      ts.push_back({p + "mlp.experts.w2_weight", {o.experts, h, h}, 'f'});
    } else {
      ts.push_back({p + "mlp.gate_proj.weight", {inter, h}, 'c'});
      ts.push_back({p + "mlp.up_proj.weight", {inter, h}, 'c'});
      ts.push_back({p + "mlp.down_proj.weight", {h, inter}, 'r'});
    }
    ts.push_back({p + "input_layernorm.weight", {h}, 'n'});
  }
  ts.push_back({"lm_head.weight", {o.vocab, h}, 'c'});
  std::string json;
  for (const auto& t : ts) {
    std::string placements;
    if (trainer)
      placements = R"([{"shard":{"dim":0}}])";
    else if (t.kind == 'c')
      placements = R"([{"replicate":{}},{"shard":{"dim":0}}])";
    else if (t.kind == 'r')
      placements = R"([{"replicate":{}},{"shard":{"dim":1}}])";
    else if (t.kind == 'e')  // experts across nodes, their intermediate dim across a node's ranks
      placements = R"([{"shard":{"dim":0}},{"shard":{"dim":1}}])";
    else if (t.kind == 'f')
      placements = R"([{"shard":{"dim":0}},{"shard":{"dim":2}}])";
    else
      placements = R"([{"replicate":{}},{"replicate":{}}])";
    json += fmt::format(R"({}{{"name":"{}","shape":[{}],"dtype":"bfloat16","placements":{}}})", json.empty() ? "" : ",",
                        t.name, fmt::join(t.shape, ","), placements);
  }
  if (trainer)
    return fmt::format(
        R"({{"group":"trainer","mesh":{{"shape":[{}]}},"ranks_per_node":4,"node_prefix":"trainer-","tensors":[{}]}})",
        o.trainer_nodes * 4, json);
  std::string fused;
  for (int l = 0; l < o.layers; ++l)
    fused +=
        o.experts > 0
            ? fmt::format(
                  R"({}{{"name":"model.layers.{}.self_attn.qkv_proj.weight","dim":0,"tensors":["model.layers.{}.self_attn.q_proj.weight","model.layers.{}.self_attn.k_proj.weight","model.layers.{}.self_attn.v_proj.weight"]}})",
                  l ? "," : "", l, l, l, l)
            : fmt::format(
                  R"({}{{"name":"model.layers.{}.self_attn.qkv_proj.weight","dim":0,"tensors":["model.layers.{}.self_attn.q_proj.weight","model.layers.{}.self_attn.k_proj.weight","model.layers.{}.self_attn.v_proj.weight"]}},{{"name":"model.layers.{}.mlp.gate_up_proj.weight","dim":0,"tensors":["model.layers.{}.mlp.gate_proj.weight","model.layers.{}.mlp.up_proj.weight"]}})",
                  l ? "," : "", l, l, l, l, l, l, l);
  return fmt::format(
      R"({{"group":"vllm","mesh":{{"shape":[{},4],"dim_names":["{}","tp"]}},"ranks_per_node":4,"node_prefix":"inference-","tensors":[{}],"fused":[{}]}})",
      o.inference_nodes, o.experts > 0 ? "ep" : "dp", json, fused);
}

uint16_t valueOf(size_t tensor, int64_t flat, int version) {
  return static_cast<uint16_t>(tensor * 7919 + static_cast<uint64_t>(flat) * 31 +
                               static_cast<uint64_t>(version) * 1009);
}

// Writes (or, with check, counts mismatches of) every element a rank holds.
int64_t visit(const planner::ResolvedLayout& l, int32_t rank, const HostTensors& m, int version, bool check) {
  int64_t bad = 0;
  std::vector<uint16_t*> base(l.buffer_names.size(), nullptr);
  for (size_t b = 0; b < base.size(); ++b) base[b] = m.as<uint16_t>(l.buffer_names[b]).data();
  planner::forEachElement(l, rank, [&](size_t t, const planner::PieceRef& p, int64_t off, int64_t flat) {
    uint16_t* e = base[static_cast<size_t>(p.buffer)] + off;
    if (check)
      bad += *e != valueOf(t, flat, version);
    else
      *e = valueOf(t, flat, version);
  });
  return bad;
}

StatusOr<Client> connectTo(const Daemon& d) { return Client::connect("unix:" + d.socketPath()); }

// CPU seconds (user + system) process `pid` has used, from /proc (0 when it cannot be read).
double cpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');  // after the command name, which may hold spaces
  if (close == std::string::npos) return 0;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && fields >> field; ++i)  // fields 14 and 15: utime, stime
    if (i >= 14) ticks += std::stod(field);
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// One shardcastd per node, by node name; `names` in start order (trainer nodes first).
struct Cluster {
  std::vector<std::string> names;
  std::map<std::string, std::unique_ptr<Daemon>> daemons;
  Daemon& of(const std::string& node) { return *daemons[node]; }
};

// The flags every daemon gets: the demo's own, then --daemon-arg's as they are.
std::vector<std::string> daemonFlags(const Options& o) {
  std::vector<std::string> extra;
  if (!o.tls.empty()) extra = {"--ucx-tls", o.tls};
  if (o.chunk_mib > 0) {
    extra.push_back("--chunk-mib");
    extra.push_back(std::to_string(o.chunk_mib));
  }
  if (o.window_mib > 0) {
    extra.push_back("--window-mib");
    extra.push_back(std::to_string(o.window_mib));
  }
  if (o.staging_mib > 0) {
    extra.push_back("--staging-mib");
    extra.push_back(std::to_string(o.staging_mib));
  }
  extra.insert(extra.end(), o.daemon_args.begin(), o.daemon_args.end());
  return extra;
}

// One daemon per node, each knowing all the others: false (said on stderr) when one does not start.
bool startCluster(const Options& o, const std::string& daemon_path, Cluster& c) {
  for (int i = 0; i < o.trainer_nodes; ++i) c.names.push_back(fmt::format("trainer-{}", i));
  for (int i = 0; i < o.inference_nodes; ++i) c.names.push_back(fmt::format("inference-{}", i));
  const auto& names = c.names;
  std::vector<int> ports;
  std::vector<std::string> hosts, peers;
  const std::vector<int> local_ports = examples::freePortsBelowEphemeral(static_cast<int>(names.size()));
  if (!o.netns && local_ports.size() < names.size()) throw std::runtime_error("not enough free TCP ports on 127.0.0.1");
  for (size_t i = 0; i < names.size(); ++i) {
    ports.push_back(o.netns ? 7070 : local_ports[i]);
    hosts.push_back(o.netns ? fmt::format("10.77.0.{}", i + 2) : "127.0.0.1");
    peers.push_back(fmt::format("{}:{}", hosts.back(), ports.back()));
  }
  const std::vector<std::string> extra = daemonFlags(o);
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<std::string> launcher;
    if (o.netns) launcher = {"ip", "netns", "exec", "sc-" + names[i]};
    c.daemons[names[i]] = std::make_unique<Daemon>(names[i], ports[i], peers, extra, daemon_path, hosts[i], launcher);
    if (!c.daemons[names[i]]->ready()) {
      fmt::print(stderr, "shardcastd for {} did not start: {}\n", names[i], c.daemons[names[i]]->readyLine());
      return false;
    }
  }
  return true;
}

// A rank's buffers in a fresh shared-memory segment, its pages touched: an inference server's
// weights are loaded before the first sync, so the first sync's figure is not the kernel's page
// zeroing.
HostTensors touchedTensors(const v1::Layout& proto, int32_t rank) {
  auto tensors = HostTensors::forRank(proto, rank);
  if (!tensors.ok()) throw std::runtime_error(std::string(tensors.status().message()));
  for (const auto& [name, slot] : tensors->buffers()) std::memset(tensors->bytes(name).data(), 0, slot.bytes);
  return std::move(*tensors);
}

// Registers every rank of layout `l` with its node's daemon, its memory appended to `mem` (with
// --double-buffered, a destination's second set to `shadow`).
void registerRanks(const Options& o, Cluster& c, const planner::NodeTable& nodes, const v1::Layout& proto,
                   const planner::ResolvedLayout& l, v1::Role role, std::vector<HostTensors>& mem,
                   std::vector<HostTensors>& shadow) {
  for (int32_t r = 0; r < l.world(); ++r) {
    mem.push_back(touchedTensors(proto, r));
    auto client = connectTo(c.of(nodes.name(l.rank_node[r])));
    if (!client.ok()) throw std::runtime_error(std::string(client.status().message()));
    auto options = role == v1::ROLE_SOURCE ? RegisterOptions::source() : RegisterOptions{};
    if (role == v1::ROLE_DESTINATION && o.double_buffered) {
      shadow.push_back(touchedTensors(proto, r));
      options = RegisterOptions::doubleBuffered(shadow.back().handles());
    }
    if (auto st = client->registerRank(proto, r, mem.back(), options); !st.ok())
      throw std::runtime_error(std::string(st.status().message()));
  }
}

// The trainer's side of the fences: acquire its ranks (waits until no sync reads them), write
// version v, publish the version they now hold.
void trainerStep(std::vector<Client>& trainer, const planner::ResolvedLayout& src, std::vector<HostTensors>& smem,
                 int v) {
  for (int32_t r = 0; r < src.world(); ++r)
    if (auto st = trainer[r].acquire("trainer", r); !st.ok())
      throw std::runtime_error(std::string(st.status().message()));
  for (int32_t r = 0; r < src.world(); ++r) visit(src, r, smem[r], v, false);
  for (int32_t r = 0; r < src.world(); ++r)
    if (auto st = trainer[r].publish("trainer", r, static_cast<uint64_t>(v)); !st.ok())
      throw std::runtime_error(std::string(st.status().message()));
}

// A sync's CPU seconds (clock ticks of 10 ms): its coordinator's and every daemon's together.
struct CpuUse {
  double coordinator = 0, daemons = 0;
};

// Sync v's lines: its throughput and check, its RESULT line (--report), its phases' times.
void printSync(const Options& o, const std::string& strategy, int v, const v1::SyncResponse& out, int64_t bad,
               const CpuUse& cpu) {
  fmt::print(
      "sync v{}: {} to destination ranks ({} over the network, {} wave{}) in {:.3f} s = {:.2f} GB/s delivered{}; "
      "verified: {}\n",
      v, planner::humanBytes(static_cast<double>(out.bytes_needed())),
      planner::humanBytes(static_cast<double>(out.network_bytes())), out.waves(), out.waves() == 1 ? "" : "s",
      out.seconds(), static_cast<double>(out.bytes_needed()) / out.seconds() / 1e9,
      out.plan_cached() ? " (plan cached)" : "",
      bad == 0 ? "every byte correct" : fmt::format("{} WRONG elements", bad));
  if (o.report)
    fmt::print(
        "RESULT sync strategy={} v={} seconds={:.6f} gather={:.6f} plan={:.6f} prepare={:.6f} execute={:.6f} "
        "finish={:.6f} network_bytes={} bytes_needed={} wrong={} repeated={} folded={} coordinator_calls={} "
        "coordinator_cpu={:.3f} daemons_cpu={:.3f}\n",
        strategy, v, out.seconds(), out.gather_seconds(), out.plan_seconds(), out.prepare_seconds(),
        out.execute_seconds(), out.finish_seconds(), out.network_bytes(), out.bytes_needed(), bad,
        out.repeated() ? 1 : 0, out.folded() ? 1 : 0, out.coordinator_calls(), cpu.coordinator, cpu.daemons);
  fmt::print(
      "         gather {:.3f} s, plan {:.3f} s, prepare {:.3f} s, execute {:.3f} s, finish {:.3f} s; {} landed "
      "straight in rank buffers\n",
      out.gather_seconds(), out.plan_seconds(), out.prepare_seconds(), out.execute_seconds(), out.finish_seconds(),
      planner::humanBytes(static_cast<double>(out.bytes_landed_direct())));
}

// Syncs version v by `strategy` from its coordinator (the first node), checks every element of
// `landed` and prints the figures: how many elements are wrong, or the sync's error.
StatusOr<int64_t> syncAndVerify(const Options& o, Cluster& c, Client& coordinator, const std::string& strategy, int v,
                                const planner::ResolvedLayout& dst, std::vector<HostTensors>& landed) {
  SyncOptions so;
  so.verify = o.verify;
  so.timeout = std::chrono::minutes(10);
  so.strategy = kStrategies.at(strategy);
  std::vector<double> cpu_before;
  for (const auto& node : c.names) cpu_before.push_back(cpuSeconds(c.of(node).pid()));
  auto synced = coordinator.sync("trainer", "vllm", static_cast<uint64_t>(v), so);
  CpuUse cpu;
  for (size_t i = 0; i < c.names.size(); ++i) {
    const double used = cpuSeconds(c.of(c.names[i]).pid()) - cpu_before[i];
    cpu.daemons += used;
    if (i == 0) cpu.coordinator = used;
  }
  if (!synced.ok()) return synced.status();
  int64_t bad = 0;
  for (int32_t r = 0; r < dst.world(); ++r) bad += visit(dst, r, landed[r], v, true);
  printSync(o, strategy, v, *synced, bad, cpu);
  return bad;
}

int run(const Options& o, const std::string& daemon_path) {
  const auto src_proto = planner::parseLayoutJson(layoutJson(o, true), "trainer");
  const auto dst_proto = planner::parseLayoutJson(layoutJson(o, false), "vllm");
  if (!src_proto.ok() || !dst_proto.ok()) {
    fmt::print(stderr, "demo layouts: {}\n",
               std::string((src_proto.ok() ? dst_proto.status() : src_proto.status()).message()));
    return 1;
  }
  planner::NodeTable nodes;
  const auto src = *planner::resolveLayout(*src_proto, nodes);
  const auto dst = *planner::resolveLayout(*dst_proto, nodes);
  Cluster cluster;
  if (!startCluster(o, daemon_path, cluster)) return 1;
  fmt::print("started {} daemons ({} trainer nodes, {} inference nodes) {}\n", cluster.names.size(), o.trainer_nodes,
             o.inference_nodes, o.netns ? "in network namespaces (bench/cluster.sh)" : "on loopback");

  // Each rank's weights live in a shared-memory segment the rank (here: this process) writes into
  // and its node's daemon reads and writes directly.
  std::vector<HostTensors> smem, dmem, shadow;  // shadow: the inference ranks' second sets
  registerRanks(o, cluster, nodes, *src_proto, src, v1::ROLE_SOURCE, smem, shadow);
  registerRanks(o, cluster, nodes, *dst_proto, dst, v1::ROLE_DESTINATION, dmem, shadow);
  std::vector<Client> trainer;
  for (int32_t r = 0; r < src.world(); ++r) {
    auto client = connectTo(cluster.of(nodes.name(src.rank_node[r])));
    if (!client.ok()) throw std::runtime_error(std::string(client.status().message()));
    trainer.push_back(std::move(*client));
  }
  auto coordinator = connectTo(cluster.of(cluster.names[0]));
  if (!coordinator.ok()) throw std::runtime_error(std::string(coordinator.status().message()));
  int failures = 0, v = 0;
  for (const std::string& name : o.strategies) {
    auto plan = coordinator->plan("trainer", "vllm", o.nic_gbps, kStrategies.at(name));
    if (!plan.ok()) throw std::runtime_error(std::string(plan.status().message()));
    if (o.strategies.size() > 1) fmt::print("== strategy {}\n", name);
    fmt::print("{}\n", plan->summary_text());
    if (o.report) fmt::print("RESULT plan strategy={} {}\n", name, plan->summary_json());
    for (int s = 1; s <= o.syncs; ++s) {
      trainerStep(trainer, src, smem, ++v);  // the trainer's step v
      // Double-buffered: the first sync writes the second set, and every commit flips.
      auto& landed = o.double_buffered && v % 2 == 1 ? shadow : dmem;
      const auto bad = syncAndVerify(o, cluster, *coordinator, name, v, dst, landed);
      if (!bad.ok()) {
        fmt::print(stderr, "sync {} ({}) failed: {}\n", v, name, std::string(bad.status().message()));
        return 1;
      }
      failures += *bad != 0;
    }
  }
  return failures == 0 ? 0 : 1;
}

// Reads --strategies' comma-separated list into o.strategies.
void setStrategies(Options& o, const std::string& list) {
  o.strategies.clear();
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    const std::string name = list.substr(at, comma - at);
    if (!kStrategies.count(name))
      throw std::invalid_argument("unknown strategy \"" + name + "\" (planned, rank-pull, gather-broadcast)");
    o.strategies.push_back(name);
    at = comma + 1;
  }
}

// Sets the option `flag` names, its value (where it takes one) from `next`; throws for a flag
// it does not know or a value it cannot read.
void setOption(Options& o, const std::string& flag, const std::function<std::string()>& next) {
  if (flag == "--layers")
    o.layers = std::stoi(next());
  else if (flag == "--hidden")
    o.hidden = std::stoll(next());
  else if (flag == "--syncs")
    o.syncs = std::stoi(next());
  else if (flag == "--trainer-nodes")
    o.trainer_nodes = std::stoi(next());
  else if (flag == "--inference-nodes")
    o.inference_nodes = std::stoi(next());
  else if (flag == "--ucx-tls")
    o.tls = next();
  else if (flag == "--staging-mib")
    o.staging_mib = std::stoll(next());
  else if (flag == "--chunk-mib")
    o.chunk_mib = std::stoll(next());
  else if (flag == "--window-mib")
    o.window_mib = std::stoll(next());
  else if (flag == "--verify")
    o.verify = true;
  else if (flag == "--double-buffered")
    o.double_buffered = true;
  else if (flag == "--daemon-arg")
    o.daemon_args.push_back(next());
  else if (flag == "--netns")
    o.netns = true;
  else if (flag == "--nic-gbps")
    o.nic_gbps = std::stod(next());
  else if (flag == "--report")
    o.report = true;
  else if (flag == "--vocab")
    o.vocab = std::stoll(next());
  else if (flag == "--experts")
    o.experts = std::stoll(next());
  else if (flag == "--strategies")
    setStrategies(o, next());
  else
    throw std::invalid_argument("unknown option " + flag);
}

// Reads the command line into `o`: the exit code when the demo ends here (0 after --help, 2 for
// a bad option or value, said on stderr with the usage).
std::optional<int> parseOptions(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string inline_value;  // --flag=value
    const bool has_inline = a.rfind("--", 0) == 0 && a.find('=') != std::string::npos;
    if (has_inline) {
      inline_value = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
    }
    auto next = [&]() -> std::string {
      if (has_inline) return inline_value;
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    }
    try {
      setOption(o, a, next);
    } catch (const std::exception& e) {
      fmt::print(stderr, "shardcast-demo: {}\n{}", e.what(), kUsage);
      return 2;
    }
  }
  if (o.netns && o.trainer_nodes + o.inference_nodes > 250) {
    fmt::print(stderr, "shardcast-demo: --netns takes at most 250 nodes (10.77.0.2-251)\n");
    return 2;
  }
  if (o.layers < 1 || o.hidden < 16 || o.hidden % 16 || o.syncs < 1 || o.trainer_nodes < 1 || o.inference_nodes < 1 ||
      o.vocab < 1 || o.experts < 0) {
    fmt::print(stderr, "shardcast-demo: --layers/--syncs/--*-nodes must be >= 1 and --hidden a multiple of 16\n");
    return 2;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const auto exit_code = parseOptions(argc, argv, o)) return *exit_code;
  const auto daemon_path = (std::filesystem::canonical("/proc/self/exe").parent_path() / "shardcastd").string();
  try {
    return run(o, daemon_path);
  } catch (const std::exception& e) {
    fmt::print(stderr, "shardcast-demo: {}\n", e.what());
    return 1;
  }
}

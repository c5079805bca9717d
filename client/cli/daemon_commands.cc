#include "client/cli/daemon_commands.h"

#include <fmt/format.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <ctime>
#include <iostream>
#include <memory>
#include <random>
#include <thread>
#include <tuple>
#include <utility>

#include "client/cli/exit_codes.h"
#include "client/cli/progress_view.h"
#include "client/cli/top_view.h"
#include "client/lib/client.h"
#include "common/grpc_status.h"
#include "common/strings.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "planner/limits.h"
#include "planner/report.h"

namespace shardcast::cli {

namespace {

struct CommonArgs {
  std::string daemon;
  bool json = false;
};

void addCommon(CLI::App* cmd, CommonArgs* a) {
  cmd->add_option("--daemon", a->daemon,
                  "shardcastd to talk to: host:port, unix:PATH or a socket path (default: $SHARDCAST_ADDRESS, "
                  "$SHARDCAST_SOCKET, else /run/shardcast/shardcastd.sock)");
  cmd->add_flag("--json", a->json, "Print JSON for scripts instead of text");
}

// `text` as a JSON string literal.
std::string toJsonString(const std::string& text) {
  google::protobuf::Value v;
  v.set_string_value(text);
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(v, &out).ok()) return "\"\"";
  return out;
}

std::string toJson(const google::protobuf::Message& m) {
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  o.always_print_primitive_fields = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(m, &out, o).ok()) return "{}";
  return out;
}

// Connects, or prints why not and sets the exit code: kUntrusted for a daemon that answers as a
// uid this client does not trust (checkDaemonUid), kUnreachable otherwise.
std::unique_ptr<Client> connectOrReport(const std::string& cmd, const CommonArgs& a, int* exit_code) {
  auto c = Client::connect(a.daemon.empty() ? defaultDaemonTarget() : a.daemon);
  if (!c.ok()) {
    std::cerr << "shardcast " << cmd << ": " << c.status().message() << "\n";
    *exit_code = absl::IsPermissionDenied(c.status()) ? kUntrusted : kUnreachable;
    return nullptr;
  }
  return std::make_unique<Client>(std::move(*c));
}

int failed(const std::string& cmd, const Status& st) {
  std::cerr << "shardcast " << cmd << ": " << absl::StatusCodeToString(st.code()) << ": " << st.message() << "\n";
  return kSyncFailed;
}

std::string newSyncId() {
  std::random_device rd;
  return fmt::format("cli-{:08x}", rd());
}

// ---- sync ----

struct SyncArgs : CommonArgs {
  std::string src, dst, sync_id;
  uint64_t version = 0;
  double timeout_s = 0;
  bool verify = false, wait_for_ranks = false, no_progress = false;
  std::string delta = "off";
  std::string strategy = "planned";
  uint32_t min_replicas = 0;
  double replica_deadline_s = 0;
};

int runSync(const SyncArgs& a) {
  if (a.version == 0) {
    std::cerr << "shardcast sync: --version must be at least 1 (a destination starts at version 0)\n";
    return kUsage;
  }
  int rc = kOk;
  auto client = connectOrReport("sync", a, &rc);
  if (!client) return rc;
  SyncOptions o;
  o.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  o.verify = a.verify;
  o.wait_for_ranks = a.wait_for_ranks;
  o.delta = a.delta == "auto"     ? v1::DELTA_AUTO
            : a.delta == "dense"  ? v1::DELTA_DENSE
            : a.delta == "always" ? v1::DELTA_ALWAYS
                                  : v1::DELTA_OFF;
  o.strategy = a.strategy == "rank-pull"          ? v1::STRATEGY_RANK_PULL
               : a.strategy == "gather-broadcast" ? v1::STRATEGY_GATHER_BROADCAST
                                                  : v1::STRATEGY_PLANNED;
  o.sync_id = a.sync_id.empty() ? newSyncId() : a.sync_id;
  o.min_replicas = a.min_replicas;
  o.replica_deadline = std::chrono::milliseconds(static_cast<int64_t>(a.replica_deadline_s * 1000));

  // The sync runs in its own thread; this one watches it and draws the progress.
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  const bool show = !a.no_progress && (tty || !a.json);
  WatchCancel cancel;
  StatusOr<v1::SyncResponse> result = absl::UnknownError("not run");
  std::thread syncer([&] {
    result = client->sync(a.src, a.dst, a.version, o);
    cancel.cancel();
  });
  if (show) {
    ProgressView view(stderr, tty);
    client
        ->watch(
            o.sync_id,
            [&](const v1::SyncProgress& p) {
              view.update(p);
              return true;
            },
            &cancel)
        .ok();  // the sync's own result decides the outcome
    view.finish();
  }
  syncer.join();
  if (!result.ok()) return failed("sync", result.status());
  const auto& r = *result;
  if (a.json) {
    std::cout << toJson(r) << "\n";
    return kOk;
  }
  const double gbps = r.seconds() > 0 ? static_cast<double>(r.network_bytes()) / r.seconds() / 1e9 : 0;
  std::cout << fmt::format(
      "sync {} committed: \"{}\" -> \"{}\" version {}\n"
      "  {} needed, {} over the network, {} node-local, {} wave(s)\n"
      "  {:.3f} s ({:.2f} GB/s network): gather {:.3f} s{}, plan {:.3f} s{}, prepare {:.3f} s{}, execute {:.3f} s, "
      "finish {:.3f} s\n",
      shown(r.sync_id()), shown(a.src), shown(a.dst), r.version(),
      planner::humanBytes(static_cast<double>(r.bytes_needed())),
      planner::humanBytes(static_cast<double>(r.network_bytes())),
      planner::humanBytes(static_cast<double>(r.local_bytes())), r.waves(), r.seconds(), gbps, r.gather_seconds(),
      r.repeated() ? " (skipped: it repeats the last sync)" : "", r.plan_seconds(), r.plan_cached() ? " (cached)" : "",
      r.prepare_seconds(),
      r.folded()                               ? " (folded into the first wave)"
      : r.layouts_by_digest() && !r.repeated() ? " (layouts by digest)"
                                               : "",
      r.execute_seconds(), r.finish_seconds());
  for (const auto& replica : r.replicas())  // a replica set: each replica, committed, cut or left, and why
    std::cout << (replica.committed()
                      ? fmt::format("  replica {} ({}): committed\n", replica.replica(), shown(replica.group()))
                      : fmt::format("  replica {} ({}): {}: {}\n", replica.replica(), shown(replica.group()),
                                    replica.left() ? "left" : "cut", shown(replica.cut())));
  if (r.delta() != v1::DELTA_OFF)
    std::cout << fmt::format(
        "  {} on the wire ({:.1f}% of dense): {} chunk landing(s) as deltas, {} dense\n",
        planner::humanBytes(static_cast<double>(r.wire_bytes())),
        r.network_bytes() ? 100.0 * static_cast<double>(r.wire_bytes()) / static_cast<double>(r.network_bytes()) : 0.0,
        r.delta_chunks(), r.dense_chunks());
  if (!r.delta_choice().empty()) std::cout << fmt::format("  dense: {}\n", shown(r.delta_choice()));
  return kOk;
}

// ---- watch ----

struct WatchArgs : CommonArgs {
  std::string sync_id;
};

int runWatch(const WatchArgs& a) {
  int rc = kOk;
  auto client = connectOrReport("watch", a, &rc);
  if (!client) return rc;
  const bool tty = ::isatty(STDERR_FILENO) != 0;
  ProgressView view(stderr, tty);
  v1::SyncProgress last;
  const Status st = client->watch(a.sync_id, [&](const v1::SyncProgress& p) {
    last = p;
    if (a.json)
      std::cout << toJson(p) << std::endl;  // JSON lines, one per update
    else
      view.update(p);
    return true;
  });
  view.finish();
  if (!st.ok()) return failed("watch", st);
  if (!a.json) std::cout << "sync " << shown(a.sync_id) << ": " << ProgressView::describe(last) << "\n";
  return last.phase() == v1::SYNC_COMMITTED ? kOk : kSyncFailed;
}

// ---- status ----

int runStatus(const CommonArgs& a) {
  int rc = kOk;
  auto client = connectOrReport("status", a, &rc);
  if (!client) return rc;
  auto s = client->status();
  if (!s.ok()) return failed("status", s.status());
  if (a.json) {
    std::cout << toJson(*s) << "\n";
    return kOk;
  }
  // Counted as `top` counts them: the other daemons (this one is listed among its peers too).
  int reachable = 0, others = 0;
  for (const auto& p : s->peers())
    if (p.node() != s->node()) {
      ++others;
      reachable += p.reachable();
    }
  std::cout << fmt::format("node        {} (shardcastd {}, transport {}, up {:.0f} s)\n", shown(s->node()),
                           s->version(), shown(s->transport()), s->uptime_seconds());
  std::cout << fmt::format("registered  {} rank(s), {}\n", s->registered_ranks(),
                           planner::humanBytes(static_cast<double>(s->registered_bytes())));
  std::cout << fmt::format("peers       {}/{} reachable\n", reachable, others);
  for (const auto& p : s->peers())
    std::cout << fmt::format("  {:<24} {:<16} {}\n", shown(p.address()), p.node().empty() ? "-" : shown(p.node()),
                             p.node() == s->node() ? "this daemon"
                             : p.reachable()       ? "ok"
                                                   : "unreachable: " + shown(p.error()));
  std::cout << fmt::format("groups      {}\n", s->groups_size());
  if (s->groups_size() > 0)
    std::cout << fmt::format("  {:<20} {:<11} {:>8} {:>6} {:>12}  {}\n", "GROUP", "ROLE", "VERSION", "WORLD", "BYTES",
                             "RANKS HERE (state)");
  for (const auto& g : s->groups()) {
    std::vector<std::string> ranks;
    for (const auto& r : g.rank_states()) ranks.push_back(fmt::format("{}:{}", r.rank(), describeRank(r)));
    std::cout << fmt::format("  {:<20} {:<11} {:>8} {:>6} {:>12}  {}\n", shown(g.group()), v1::roleName(g.role()),
                             g.version(), g.world_size(),
                             planner::humanBytes(static_cast<double>(g.registered_bytes())), fmt::join(ranks, " "));
    for (const auto& r : g.rank_states())
      if (r.state() == v1::RANK_DIRTY)
        std::cout << fmt::format("    rank {} is dirty: {}\n", r.rank(), shown(r.detail()));
  }
  return kOk;
}

// ---- top ----

struct TopArgs : CommonArgs {
  double interval_s = 2;
  bool once = false;
};

// The terminal's columns and rows (80 x 0, no limit on rows, when stdout is not a terminal).
std::pair<int, int> terminalSize() {
  winsize w{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &w) == 0 && w.ws_col > 0) return {w.ws_col, w.ws_row};
  return {80, 0};
}

std::string wallClock() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  ::localtime_r(&now, &local);
  char text[16];
  std::strftime(text, sizeof(text), "%H:%M:%S", &local);
  return text;
}

// Redraws the cluster's screen every interval until interrupted (--once: one screen, then exit).
// A daemon that stops answering is shown as such, and the view recovers when it answers again.
int runTop(const TopArgs& a) {
  int rc = kOk;
  auto client = connectOrReport("top", a, &rc);
  if (!client) return rc;
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  while (true) {
    auto status = client->status(/*all_nodes=*/true);
    // The cluster's ranks; while a peer does not answer, this daemon's own (and the screen says so).
    std::string note;
    auto ranks = status.ok() ? client->list(/*all_nodes=*/true) : StatusOr<v1::ListResponse>(status.status());
    if (status.ok() && !ranks.ok()) {
      note = fmt::format("ranks of this node only: {}", std::string(ranks.status().message()));
      ranks = client->list(/*all_nodes=*/false);
    }
    const Status st = status.ok() ? ranks.status() : status.status();
    if (!st.ok() && a.once) return failed("top", st);
    std::string screen;
    if (!st.ok() && a.json) {
      screen = fmt::format(R"({{"error":{{"code":"{}","message":{}}}}})", absl::StatusCodeToString(st.code()),
                           toJsonString(std::string(st.message()))) +
               "\n";
    } else if (!st.ok()) {
      screen = fmt::format("shardcast top - {}\n\n  the daemon does not answer: {}: {}\n  (retrying every {} s)\n",
                           wallClock(), absl::StatusCodeToString(st.code()), std::string(st.message()), a.interval_s);
    } else if (a.json) {
      screen = fmt::format(R"({{"status":{},"ranks":{}}})", toJson(*status), toJson(*ranks)) + "\n";
    } else {
      TopScreen view;
      if (tty) std::tie(view.width, view.height) = terminalSize();
      if (a.once) view.height = 0;  // one screen for reading or a script: all of it
      view.clock = wallClock();
      view.note = note;
      screen = renderTop(*status, *ranks, view);
    }
    if (tty && !a.once && !a.json) {
      // Home, then each line over the last screen's, clearing what is left of it.
      std::string frame = "\033[H";
      for (size_t at = 0; at < screen.size();) {
        const size_t end = screen.find('\n', at);
        frame += screen.substr(at, end - at) + "\033[K\n";
        at = end == std::string::npos ? screen.size() : end + 1;
      }
      std::cout << frame << "\033[J" << std::flush;
    } else {
      std::cout << screen << (a.json ? "" : "\n") << std::flush;
    }
    if (a.once) return kOk;
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int64_t>(a.interval_s * 1000)));
  }
}

// ---- layouts ----

struct LayoutsArgs : CommonArgs {
  bool local = false;
};

int runLayouts(const LayoutsArgs& a) {
  int rc = kOk;
  auto client = connectOrReport("layouts", a, &rc);
  if (!client) return rc;
  auto l = client->list(!a.local);
  if (!l.ok()) return failed("layouts", l.status());
  if (a.json) {
    std::cout << toJson(*l) << "\n";
    return kOk;
  }
  std::cout << fmt::format("{:<20} {:>5} {:>6} {:<16} {:<11} {:<16} {:>12} {:>8}  {}\n", "GROUP", "RANK", "WORLD",
                           "NODE", "ROLE", "STATE", "BYTES", "BUFFERS", "LAYOUT DIGEST");
  for (const auto& r : l->ranks()) {
    v1::RankStatus st;
    st.set_state(r.state());
    st.set_version(r.version());
    st.set_held(r.held());
    std::cout << fmt::format("{:<20} {:>5} {:>6} {:<16} {:<11} {:<16} {:>12} {:>8}  {}\n", shown(r.group()), r.rank(),
                             r.world_size(), shown(r.node()), v1::roleName(r.role()), describeRank(st),
                             planner::humanBytes(static_cast<double>(r.registered_bytes())), r.buffers_size(),
                             shown(r.layout_digest()));
  }
  if (l->ranks_size() == 0) std::cout << "(nothing registered)\n";
  return kOk;
}

// ---- wait ----

struct WaitArgs : CommonArgs {
  std::string group;
  uint64_t version = 0;
  double timeout_s = 60;
};

int runWait(const WaitArgs& a) {
  int rc = kOk;
  auto client = connectOrReport("wait", a, &rc);
  if (!client) return rc;
  // The query form: a version not reached in time is reported (exit 5), not an error of the call.
  auto out = client->waitReady(a.group, a.version, std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000)));
  if (!out.ok()) return failed("wait", out.status());
  const uint64_t v = out->version();
  const bool reached = v >= a.version;
  if (a.json)
    std::cout << fmt::format(R"({{"group":"{}","version":{},"reached":{}}})", a.group, v, reached) << "\n";
  else
    std::cout << fmt::format("group \"{}\" is at version {}{}\n", shown(a.group), v,
                             reached ? "" : fmt::format(" (waited {:.0f} s for {})", a.timeout_s, a.version));
  return reached ? kOk : kSyncFailed;
}

// ---- fences: acquire, publish, release ----

struct FenceArgs : CommonArgs {
  std::string group;
  int32_t rank = 0;
  uint64_t version = 0;
  double timeout_s = 30;
};

int runFence(const std::string& cmd, const FenceArgs& a) {
  int rc = kOk;
  auto client = connectOrReport(cmd, a, &rc);
  if (!client) return rc;
  StatusOr<v1::RankStatus> st = absl::UnknownError("");
  if (cmd == "acquire")
    st = client->acquire(a.group, a.rank, std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000)));
  else if (cmd == "publish")
    st = client->publish(a.group, a.rank, a.version);
  else
    st = client->release(a.group, a.rank);
  if (!st.ok()) return failed(cmd, st.status());
  if (a.json)
    std::cout << toJson(*st) << "\n";
  else
    std::cout << fmt::format("group \"{}\" rank {}: {}\n", shown(a.group), a.rank, describeRank(*st));
  return kOk;
}

// ---- health ----

struct HealthArgs : CommonArgs {
  std::string service;
  double timeout_s = 5;
};

// grpc.health.v1 Check, as Kubernetes' gRPC probes and grpc_health_probe do.
int runHealth(const HealthArgs& a) {
  const std::string target = normalizeTarget(a.daemon.empty() ? defaultDaemonTarget() : a.daemon);
  auto channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  if (!channel->WaitForConnected(deadline)) {
    std::cerr << "shardcast health: shardcastd at \"" << target << "\" is not reachable\n";
    return kUnreachable;
  }
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(a.service);
  grpc::health::v1::HealthCheckResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline);
  const auto st = grpc::health::v1::Health::NewStub(channel)->Check(&ctx, req, &resp);
  if (!st.ok()) return failed("health", fromGrpc(st));
  const std::string status = grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status());
  if (a.json)
    std::cout << fmt::format(R"({{"service":"{}","status":"{}"}})", a.service, status) << "\n";
  else
    std::cout << status << "\n";
  return resp.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kOk : kSyncFailed;
}

}  // namespace

// Versions are below 2^63 in every client language (and "-1" must not wrap to 2^64 - 1).
const CLI::Range kVersionRange(uint64_t{1}, planner::kLastVersion, strCat("a version in ", planner::kVersionRange));

namespace {

// Each adds its subcommand (the fences: acquire, publish, release) with its flags; when it runs,
// its exit code is written to *exit_code.
void addSyncCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<SyncArgs>();
  auto* cmd = app.add_subcommand("sync", "Sync a version of one registered group into another, with live progress");
  cmd->add_option("--src", a->src, "Source group")->required();
  cmd->add_option("--dst", a->dst, "Destination group")->required();
  cmd->add_option("--version", a->version, "Version to publish (greater than the destination's)")
      ->required()
      ->check(kVersionRange);
  cmd->add_flag("--verify", a->verify, "Check per-chunk xxHash64 checksums at every destination node");
  cmd->add_option("--timeout-s", a->timeout_s, "Give up after this many seconds (0: the daemon's 300 s)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--wait-for-ranks", a->wait_for_ranks, "Wait (up to the timeout) for ranks not registered yet");
  cmd->add_option("--delta", a->delta,
                  "off: dense; auto: only the elements that changed, to nodes holding the bytes this source last "
                  "sent, while that measures faster than dense (docs/delta.md); always: deltas wherever a node "
                  "holds the base, faster or not; dense: dense, keeping the bases for later deltas")
      ->check(CLI::IsMember({"off", "auto", "always", "dense"}))
      ->capture_default_str();
  cmd->add_option("--strategy", a->strategy,
                  "planned: Shardcast's plan; rank-pull, gather-broadcast: the baselines it is measured against "
                  "(every destination rank pulling its own slices; everything through source rank 0's node), "
                  "executed by the same daemons, dense")
      ->check(CLI::IsMember({"planned", "rank-pull", "gather-broadcast"}))
      ->capture_default_str();
  cmd->add_option("--min-replicas", a->min_replicas,
                  "--dst a replica set: fail unless at least this many replicas take part (default 1)");
  cmd->add_option("--replica-deadline-s", a->replica_deadline_s,
                  "--dst a replica set: cut a replica whose node is silent this long during the sync (default: "
                  "the daemons' sync lease)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--sync-id", a->sync_id, "Id of the sync (default: a random one), for `shardcast watch`");
  cmd->add_flag("--no-progress", a->no_progress, "Print only the result");
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runSync(*a); });
}

void addWatchCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<WatchArgs>();
  auto* cmd = app.add_subcommand("watch", "Follow a sync coordinated by this daemon until it ends");
  cmd->add_option("sync_id", a->sync_id, "The sync's id")->required();
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runWatch(*a); });
}

void addStatusCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<CommonArgs>();
  auto* cmd = app.add_subcommand("status", "The daemon, its peers, its groups and their versions");
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runStatus(*a); });
}

void addTopCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<TopArgs>();
  auto* cmd = app.add_subcommand(
      "top", "A live view of the cluster: groups, versions, rank states, syncs in flight, recent failures");
  cmd->add_option("--interval-s", a->interval_s,
                  "Seconds between refreshes (each asks every daemon for its ranks and syncs)")
      ->capture_default_str()
      ->check(CLI::Range(0.5, 3600.0));
  cmd->add_flag("--once", a->once, "Print one screen and exit");
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runTop(*a); });
}

void addLayoutsCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<LayoutsArgs>();
  auto* cmd = app.add_subcommand("layouts", "What is registered across the cluster, one row per rank");
  cmd->add_flag("--local", a->local, "Only this daemon's registrations");
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runLayouts(*a); });
}

void addWaitCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<WaitArgs>();
  auto* cmd = app.add_subcommand(
      "wait", "Wait until every rank of a group on this node is ready at a version (fails on a dirty one)");
  cmd->add_option("--group", a->group, "Group")->required();
  cmd->add_option("--version", a->version, "Version to wait for")->required()->check(kVersionRange);
  cmd->add_option("--timeout-s", a->timeout_s, "Give up after this many seconds")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runWait(*a); });
}

void addFenceCommands(CLI::App& app, int* exit_code) {
  for (const std::string name : {"acquire", "publish", "release"}) {
    auto a = std::make_shared<FenceArgs>();
    const char* help =
        name == "acquire" ? "Take a rank's memory: a source to write it (waits for syncs reading it), a destination to "
                            "read it undisturbed (waits for the sync writing it)"
        : name == "publish" ? "A source rank's buffers hold this version and will not change until acquired"
                            : "A destination rank accepts updates again";
    auto* cmd = app.add_subcommand(name, help);
    cmd->add_option("--group", a->group, "Group")->required();
    cmd->add_option("--rank", a->rank, "Rank")->required();
    if (name == "publish")
      cmd->add_option("--version", a->version, "The version the rank's buffers now hold")
          ->required()
          ->check(kVersionRange);
    if (name == "acquire")
      cmd->add_option("--timeout-s", a->timeout_s, "Give up after this many seconds")
          ->capture_default_str()
          ->check(CLI::PositiveNumber);
    addCommon(cmd, a.get());
    cmd->callback([a, exit_code, name] { *exit_code = runFence(name, *a); });
  }
}

void addHealthCommand(CLI::App& app, int* exit_code) {
  auto a = std::make_shared<HealthArgs>();
  auto* cmd = app.add_subcommand("health", "Ask the daemon's grpc.health.v1 service (exit 0 when SERVING)");
  cmd->add_option("--service", a->service, "Service name to check (default: the whole server)");
  cmd->add_option("--timeout-s", a->timeout_s, "Give up after this many seconds")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  addCommon(cmd, a.get());
  cmd->callback([a, exit_code] { *exit_code = runHealth(*a); });
}

}  // namespace

void addDaemonCommands(CLI::App& app, int* exit_code) {
  addSyncCommand(app, exit_code);
  addWatchCommand(app, exit_code);
  addStatusCommand(app, exit_code);
  addTopCommand(app, exit_code);
  addLayoutsCommand(app, exit_code);
  addWaitCommand(app, exit_code);
  addFenceCommands(app, exit_code);
  addHealthCommand(app, exit_code);
}

}  // namespace shardcast::cli

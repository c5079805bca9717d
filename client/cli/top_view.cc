#include "client/cli/top_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <vector>

#include "common/strings.h"
#include "planner/report.h"

namespace shardcast::cli {

namespace {

// What `shardcast top` shows of one group, across every node that holds ranks of it.
struct GroupRow {
  v1::Role role = v1::ROLE_UNSPECIFIED;
  int32_t world = 0;
  int ranks = 0;
  std::map<v1::RankState, int> states;
  uint64_t lowest = UINT64_MAX, highest = 0;  // of the versions its READY ranks hold
  std::vector<std::string> nodes;
  std::vector<std::string> dirty;  // "rank R on N: detail"
  std::string replica_set;         // "" unless the group is a replica of a set
};

std::string cut(std::string line, int width) {
  if (width > 0 && line.size() > static_cast<size_t>(width)) line.resize(static_cast<size_t>(width));
  return line;
}

std::string versions(const GroupRow& g) {
  if (g.highest == 0) return "-";
  if (g.lowest == g.highest) return fmt::format("{}", g.highest);
  return fmt::format("{}-{}", g.lowest, g.highest);
}

bool ended(const v1::SyncProgress& p) { return p.phase() == v1::SYNC_COMMITTED || p.phase() == v1::SYNC_FAILED; }

std::string progressOf(const v1::SyncProgress& p) {
  if (p.phase() == v1::SYNC_COMMITTED) return "done";
  if (p.phase() == v1::SYNC_FAILED) return "-";
  if (p.bytes_total() == 0) return "0%";
  const double pct = 100.0 * static_cast<double>(p.bytes_done()) / static_cast<double>(p.bytes_total());
  return fmt::format("{:.0f}% w{}/{}", pct, p.waves_done(), p.waves());
}

// The screen's lines, each escaped whole and cut to the screen's width: a group, set, node or
// error text cannot move the cursor, clear the screen, set the title or write the clipboard of
// the operator's terminal (shown()).
struct ScreenLines {
  int width = 0;
  std::vector<std::string> lines;
  void add(const std::string& l) { lines.push_back(cut(shown(l), width)); }
};

// The title (this node, its daemon, how many peers answer), the peers that do not, and the note.
void addHeader(ScreenLines& out, const v1::StatusResponse& status, const TopScreen& screen) {
  int reachable = 0, peers = 0;
  std::vector<std::string> down;
  for (const auto& p : status.peers()) {
    if (p.node() == status.node()) continue;  // this daemon, listed among its peers
    ++peers;
    if (p.reachable())
      ++reachable;
    else
      down.push_back(fmt::format("{} ({})", p.node().empty() ? p.address() : p.node(), p.error()));
  }
  const std::string title = fmt::format("shardcast top - node {} - shardcastd {} - peers {}/{} reachable",
                                        status.node(), status.version(), reachable, peers);
  const int pad = screen.width - static_cast<int>(title.size()) - static_cast<int>(screen.clock.size());
  out.add(title + std::string(static_cast<size_t>(std::max(1, pad)), ' ') + screen.clock);
  for (const auto& d : down) out.add("  unreachable: " + d);
  if (!screen.note.empty()) out.add("  " + screen.note);
}

std::map<std::string, GroupRow> groupRows(const v1::ListResponse& ranks) {
  std::map<std::string, GroupRow> groups;
  for (const auto& r : ranks.ranks()) {
    auto& g = groups[r.group()];
    g.role = r.role();
    g.world = std::max(g.world, r.world_size());
    ++g.ranks;
    ++g.states[r.state()];
    if (r.state() == v1::RANK_READY) {
      g.lowest = std::min(g.lowest, r.version());
      g.highest = std::max(g.highest, r.version());
    }
    if (std::find(g.nodes.begin(), g.nodes.end(), r.node()) == g.nodes.end()) g.nodes.push_back(r.node());
    g.replica_set = r.replica_set();
    if (r.state() == v1::RANK_DIRTY)
      g.dirty.push_back(fmt::format("rank {} on {}: {}", r.rank(), r.node(), r.detail()));
  }
  return groups;
}

// The groups' table, each group's first dirty ranks under it, then one line per replica set:
// how many replicas it has and the versions they hold.
void addGroups(ScreenLines& out, const std::map<std::string, GroupRow>& groups) {
  out.add("");
  out.add(fmt::format("{:<18} {:<4} {:>9} {:>9} {:>5} {:>8} {:>5} {:>5} {:>5}", "GROUP", "ROLE", "VERSION", "RANKS",
                      "READY", "UPDATING", "DIRTY", "EMPTY", "NODES"));
  if (groups.empty()) out.add("(nothing registered)");
  for (const auto& [name, g] : groups) {
    auto count = [&](v1::RankState s) {
      const auto it = g.states.find(s);
      return it == g.states.end() ? 0 : it->second;
    };
    out.add(fmt::format("{:<18} {:<4} {:>9} {:>9} {:>5} {:>8} {:>5} {:>5} {:>5}", cut(name, 18),
                        g.role == v1::ROLE_SOURCE ? "src" : "dst", versions(g), fmt::format("{}/{}", g.ranks, g.world),
                        count(v1::RANK_READY), count(v1::RANK_UPDATING), count(v1::RANK_DIRTY), count(v1::RANK_EMPTY),
                        g.nodes.size()));
    for (size_t i = 0; i < g.dirty.size() && i < 3; ++i) out.add("  ! dirty " + g.dirty[i]);
    if (g.dirty.size() > 3) out.add(fmt::format("  ! and {} more dirty ranks", g.dirty.size() - 3));
  }
  std::map<std::string, std::vector<const GroupRow*>> sets;
  for (const auto& [name, g] : groups)
    if (!g.replica_set.empty()) sets[g.replica_set].push_back(&g);
  for (const auto& [set, members] : sets) {
    GroupRow all;
    int complete = 0;
    for (const GroupRow* m : members) {
      all.lowest = std::min(all.lowest, m->lowest);
      all.highest = std::max(all.highest, m->highest);
      complete += m->ranks == m->world;
    }
    out.add(
        fmt::format("set {}: {} replicas ({} complete), versions {}", set, members.size(), complete, versions(all)));
  }
}

// Running syncs first, then the newest ended ones (every node's, by when they started).
std::vector<const v1::SyncProgress*> syncsByRecency(const v1::StatusResponse& status) {
  std::vector<const v1::SyncProgress*> syncs;
  for (const auto& s : status.syncs()) syncs.push_back(&s);
  std::stable_sort(syncs.begin(), syncs.end(), [](const v1::SyncProgress* a, const v1::SyncProgress* b) {
    const bool ra = !ended(*a), rb = !ended(*b);
    if (ra != rb) return ra;
    return a->started_unix_seconds() > b->started_unix_seconds();
  });
  return syncs;
}

void addSyncs(ScreenLines& out, const std::vector<const v1::SyncProgress*>& syncs, size_t max_syncs) {
  out.add("");
  out.add(
      fmt::format("{:<20} {:<22} {:>5} {:<10} {:>9} {:>7}", "SYNC", "FROM -> TO", "VER", "STATE", "PROGRESS", "TIME"));
  if (syncs.empty()) out.add("(no syncs yet)");
  for (size_t i = 0; i < syncs.size() && i < max_syncs; ++i) {
    const auto& p = *syncs[i];
    out.add(fmt::format("{:<20} {:<22} {:>5} {:<10} {:>9} {:>6.1f}s", cut(p.sync_id(), 20),
                        cut(p.src_group() + " -> " + p.dst_group(), 22), p.version(), p.state(), progressOf(p),
                        p.seconds()));
  }
}

// The four most recent failed syncs, each with its error.
void addFailures(ScreenLines& out, const std::vector<const v1::SyncProgress*>& syncs, int width) {
  std::vector<const v1::SyncProgress*> failures;
  for (const auto* p : syncs)
    if (p->phase() == v1::SYNC_FAILED) failures.push_back(p);
  if (failures.empty()) return;
  out.add("");
  out.add("RECENT FAILURES");
  for (size_t i = 0; i < failures.size() && i < 4; ++i) {
    const auto& p = *failures[i];
    out.add(fmt::format("  {} v{} ({} -> {}, on {}):", p.sync_id(), p.version(), p.src_group(), p.dst_group(),
                        p.coordinator()));
    // The error on at most two lines, broken between words: its start names the node and what failed.
    const size_t room = static_cast<size_t>(std::max(20, width - 4));
    const std::string& error = p.error();
    size_t at = 0;
    for (int row = 0; row < 2 && at < error.size(); ++row) {
      size_t end = std::min(error.size(), at + room);
      if (end < error.size())
        if (const size_t space = error.rfind(' ', end); space != std::string::npos && space > at) end = space;
      out.add("    " + error.substr(at, end - at));
      at = error.find_first_not_of(' ', end);
      if (at == std::string::npos) break;
    }
  }
}

}  // namespace

std::string renderTop(const v1::StatusResponse& status, const v1::ListResponse& ranks, const TopScreen& screen) {
  ScreenLines out{screen.width, {}};
  addHeader(out, status, screen);
  addGroups(out, groupRows(ranks));
  const auto syncs = syncsByRecency(status);
  addSyncs(out, syncs, screen.max_syncs);
  addFailures(out, syncs, screen.width);
  std::vector<std::string>& lines = out.lines;
  if (screen.height > 1 && lines.size() > static_cast<size_t>(screen.height)) {
    const size_t cut_from = static_cast<size_t>(screen.height) - 1;
    const size_t hidden = lines.size() - cut_from;
    lines.resize(cut_from);
    out.add(fmt::format("({} more lines: a taller terminal shows them, or `shardcast top --once`)", hidden));
  }
  std::string text;
  for (const auto& l : lines) text += l + "\n";
  return text;
}

}  // namespace shardcast::cli

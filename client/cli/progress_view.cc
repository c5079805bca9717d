#include "client/cli/progress_view.h"

#include <fmt/format.h>

#include <map>

#include "common/strings.h"
#include "planner/report.h"

namespace shardcast::cli {

std::string ProgressView::describe(const v1::SyncProgress& p) {
  const double total = static_cast<double>(p.bytes_total());
  const double pct =
      total > 0 ? 100.0 * static_cast<double>(p.bytes_done()) / total : (p.phase() == v1::SYNC_COMMITTED ? 100 : 0);
  const double gbps = p.seconds() > 0 ? static_cast<double>(p.bytes_done()) / p.seconds() / 1e9 : 0;
  std::map<std::string, int> states;
  for (const auto& n : p.nodes()) ++states[n.state()];
  std::string nodes;
  for (const auto& [state, count] : states) nodes += fmt::format("{}{} {}", nodes.empty() ? "" : ", ", count, state);
  std::string line = fmt::format("{:<10} {:5.1f}%  {} / {}  {:.2f} GB/s  wave {}/{}  {:.1f} s", p.state(), pct,
                                 planner::humanBytes(static_cast<double>(p.bytes_done())), planner::humanBytes(total),
                                 gbps, p.waves_done(), p.waves(), p.seconds());
  if (!nodes.empty()) line += "  nodes: " + nodes;
  if (!p.error().empty()) line += "  error: " + shown(p.error());
  return line;
}

void ProgressView::update(const v1::SyncProgress& p) {
  const auto now = std::chrono::steady_clock::now();
  if (tty_) {
    const double total = static_cast<double>(p.bytes_total());
    const double frac =
        total > 0 ? static_cast<double>(p.bytes_done()) / total : (p.phase() == v1::SYNC_COMMITTED ? 1.0 : 0.0);
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(frac * kWidth + 0.5);
    const std::string bar =
        std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(kWidth - filled), '.');
    std::fprintf(out_, "\r\033[K[%s] %s", bar.c_str(), describe(p).c_str());
    std::fflush(out_);
    drawn_ = true;
    return;
  }
  if (p.state() == last_state_ && now - last_line_ < std::chrono::seconds(1)) return;
  last_state_ = p.state();
  last_line_ = now;
  std::fprintf(out_, "sync %s: %s\n", p.sync_id().c_str(), describe(p).c_str());
  std::fflush(out_);
}

void ProgressView::finish() {
  if (tty_ && drawn_) std::fprintf(out_, "\n");
  drawn_ = false;
}

}  // namespace shardcast::cli

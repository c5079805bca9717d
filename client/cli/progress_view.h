// How the CLI shows a sync's progress: a bar redrawn in place on a terminal, plain timestamped
// lines (on state changes, at most one a second otherwise) when stderr is not a terminal.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "shardcast/v1/service.pb.h"

namespace shardcast::cli {

class ProgressView {
 public:
  // Draws on `out`; `tty` picks the bar (true) or plain lines (false).
  ProgressView(std::FILE* out, bool tty) : out_(out), tty_(tty) {}
  void update(const v1::SyncProgress& p);
  // Ends the bar's line (a terminal) so that later output starts on a fresh line.
  void finish();

  // One line describing `p`: state, percent, bytes, rate, waves and node states.
  static std::string describe(const v1::SyncProgress& p);

 private:
  std::FILE* out_;
  bool tty_;
  bool drawn_ = false;
  std::string last_state_;
  std::chrono::steady_clock::time_point last_line_{};
};

}  // namespace shardcast::cli

// `shardcast top`: one screen of the cluster as a daemon sees it, redrawn in place. The screen is
// a pure function of two answers (Status with every node's syncs, List of every node's ranks), so
// it is tested without daemons or a terminal.
#pragma once

#include <string>

#include "shardcast/v1/service.pb.h"

namespace shardcast::cli {

struct TopScreen {
  int width = 80;        // every line is cut to this many columns
  int height = 0;        // at most this many lines, the last saying how many were left out (0: any)
  std::string clock;     // shown in the title ("" for none)
  size_t max_syncs = 8;  // rows of syncs: those running first, then the newest ended
  // Shown under the title: why the ranks are this daemon's only (the cluster's List failed).
  std::string note;
};

// The screen: the daemon and its peers; one row per group (role, versions, ranks by state, nodes)
// with its dirty ranks named; the syncs in flight with progress; the recent failures, each naming
// its sync, groups, version and error. Cut to the screen's height from the bottom (failures
// first, then syncs), with a last line saying so.
std::string renderTop(const v1::StatusResponse& status, const v1::ListResponse& ranks, const TopScreen& screen);

}  // namespace shardcast::cli

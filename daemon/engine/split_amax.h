// Block-scaled fp8 from source shards that cut blocks (planner::TensorLayout::split_blocks: FSDP
// world sizes whose shards are not multiples of the block). A block's scale is the amax of the
// whole block, and its pieces sit on several source ranks, maybe on several nodes:
//   prepare   each daemon computes the amax of its source ranks' parts of every split block
//             (partialAmaxes; the source ranks are fenced from Prepare on, so these are the bytes
//             its packers quantise) and returns them (PrepareResponse.split_amax);
//   combine   the coordinator checks that every node reported exactly the blocks its ranks touch
//             and takes the largest of each (combineAmaxes);
//   execute   each node gets the combined amaxes of its blocks (ExecuteRequest.split_amax), checks
//             them against its own parts (checkCombined) and quantises with them (StageSite::split).
// Every destination rank holding a piece of a block so gets the same scale, the one the whole
// block has.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/stage/convert.h"
#include "planner/layout.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

// Per block-scaled weight (by name): its split blocks' amaxes.
using SplitAmaxes = std::map<std::string, SplitAmax>;

// The largest magnitude of `region` of `weight` in a local source rank's memory (NaN: one is NaN).
using ReadAmax = std::function<StatusOr<float>(const planner::TensorLayout& weight, const planner::Region& region)>;

// The split blocks that source ranks on node `node` hold part of, per weight, and the amax of
// those parts (read with `read`).
StatusOr<SplitAmaxes> partialAmaxes(const planner::ResolvedLayout& src, int32_t node, const ReadAmax& read);

// The coordinator's step: reports[i] is the PrepareResponse.split_amax of the daemon of node
// node_ids[i] (its id in the plan, -1: not in it). FAILED_PRECONDITION naming the node when a
// report lacks a block its ranks touch or has one they do not; else, per daemon, the combined
// amaxes of the blocks it reported.
StatusOr<std::vector<SplitAmaxes>> combineAmaxes(const planner::ResolvedLayout& src,
                                                 const std::vector<int32_t>& node_ids,
                                                 const std::vector<std::string>& node_names,
                                                 const std::vector<SplitAmaxes>& reports);

// A node's check of what its coordinator combined: exactly its own blocks, each amax at least its
// own part's (NaN when its part holds NaN). FAILED_PRECONDITION naming the tensor and block.
Status checkCombined(const SplitAmaxes& own, const SplitAmaxes& combined);

void writeAmaxes(const SplitAmaxes& amaxes, google::protobuf::RepeatedPtrField<v1::BlockAmax>* out);
// INVALID_ARGUMENT when a weight repeats, the lists' sizes differ or blocks are not sorted.
StatusOr<SplitAmaxes> readAmaxes(const google::protobuf::RepeatedPtrField<v1::BlockAmax>& in);

}  // namespace shardcast::daemon

// Peer calls through a tree of daemons (v1::RelayRequest), so that a coordinator of many daemons
// handles a bounded number of replies per phase: with fanout f, n > f calls go out as f Relays,
// each to the first daemon of a contiguous subtree, which makes its own call and relays the rest
// the same way. Every call keeps its own deadline and its own outcome: a failure deep in the tree
// comes back as that daemon's status, and a relay that fails as a whole is named for its subtree.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "shardcast/v1/service.pb.h"

namespace shardcast::daemon {

class PeerSet;

struct RawCall {
  std::string address;
  // Serialized, sent after TreeOptions.common_request: protobuf merges the two (a field set in
  // both takes this one's value, repeated fields are appended). Empty: the common request alone.
  std::string request;
  std::chrono::milliseconds timeout;
};

struct RawResult {
  grpc::Status status;
  std::string response;  // serialized, when status is OK
  // Through a Relay that could not bring back the daemon's own answer: the relay failed as a whole
  // (its own call included), or the call ran out or was cut there (DEADLINE_EXCEEDED,
  // UNAVAILABLE, CANCELLED: a relay reached too late to make its calls in time, say).
  bool unconfirmed = false;
};

// A result's status, its response parsed into `out` when it is OK: INTERNAL when the daemon's
// bytes are no such message (the one place a peer's reply is parsed).
grpc::Status parseResult(const RawResult& result, google::protobuf::Message* out);

struct TreeOptions {
  std::string method;            // "Prepare", "Execute", "Finish" or "Progress"
  uint32_t fanout = 0;           // more calls than this go through Relays (0: never)
  bool stop_at_failure = false;  // see RelayRequest.stop_at_failure
  std::string common_request;    // what every call's request starts with (sent once per Relay)
  // Called with every context before its call starts and after it ended (add = false): the
  // caller's way of cancelling calls in flight at once (PeerClient::cancelAll).
  std::function<void(grpc::ClientContext&, bool add)> track;
  // Polled while waiting (every 20 ms): true cancels every call still in flight (a relay whose
  // own caller went away).
  std::function<bool()> cancelled;
};

// Makes every call (directly, or through Relays when there are more than options.fanout), and
// runs each(i, result) on this thread as results arrive (a subtree's when its relay answers).
// Returns every result once all are in. `first_here`: calls[0] is made directly whatever the
// count (a relay's own call: it must not relay to itself).
std::vector<RawResult> callTree(const PeerSet& peers, const std::vector<RawCall>& calls, const TreeOptions& options,
                                const std::function<void(size_t, const RawResult&)>& each = nullptr,
                                bool first_here = false);

// callTree for a call every daemon must get, and may get twice (the commit's Finish: a daemon
// answers a repeat with its first answer): never stopped at a failure nor cancelled, the calls
// through relays with `first_timeout` at most (direct ones keep theirs); then every call a relay
// could not confirm (RawResult::unconfirmed) is made again directly with its own timeout. A silent relay costs the
// daemons below it `first_timeout`, not the call. `again`: how many were made again.
std::vector<RawResult> callTreeReachingAll(const PeerSet& peers, const std::vector<RawCall>& calls, TreeOptions options,
                                           std::chrono::milliseconds first_timeout, size_t* again = nullptr);

// The Relay handler's work: checks the request (known method, fanout of at least 2, every
// address a peer of this daemon's cluster) and makes its calls, none past `deadline` (the
// Relay's own). `cancelled`: the caller went away.
StatusOr<v1::RelayResponse> relay(const PeerSet& peers, const v1::RelayRequest& request,
                                  std::chrono::system_clock::time_point deadline,
                                  const std::function<bool()>& cancelled);

// The subtrees callTree sends n calls out in with fanout f: [begin, end) index ranges.
std::vector<std::pair<size_t, size_t>> relayGroups(size_t n, uint32_t fanout);

// The most Relay hops below a relay given m calls (its own included) with fanout f.
int relayDepth(size_t m, uint32_t fanout);

}  // namespace shardcast::daemon

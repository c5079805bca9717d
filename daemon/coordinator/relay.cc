#include "daemon/coordinator/relay.h"

#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <set>
#include <string_view>

#include "common/strings.h"
#include "daemon/coordinator/cluster.h"

namespace shardcast::daemon {
namespace {

// Time a relay is given per hop below it to answer after its calls' own deadlines: a relay must
// report a silent daemon's DEADLINE_EXCEEDED before its own caller gives up on the relay.
constexpr std::chrono::milliseconds kHopMargin{250};
constexpr size_t kMaxRelayCalls = 1 << 16;

bool knownMethod(const std::string& m) { return m == "Prepare" || m == "Execute" || m == "Finish" || m == "Progress"; }

std::string path(const std::string& method) { return strCat("/shardcast.v1.Peer/", method); }

grpc::ByteBuffer bufferOf(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// A call's request: the common one with its own part after it (RawCall.request). `common` is
// one slice every call of the tree shares (a reference each, not a copy: a first sync's Prepare
// carries both layouts, 15 MB at a 1T MoE's 71,000 tensors, and a coordinator with 64 subtrees
// held 64 copies of it, twice).
grpc::ByteBuffer requestOf(const grpc::Slice& common, const std::string& own) {
  if (own.empty()) return grpc::ByteBuffer(&common, 1);
  if (common.size() == 0) return bufferOf(own);
  grpc::Slice slices[] = {common, grpc::Slice(own)};
  return grpc::ByteBuffer(slices, 2);
}

// A Relay's request: `relay` (with no common_request), then the shared `common` as its
// common_request field: protobuf parses fields in any order, so the bytes are those of the whole
// message, and `common` is referenced, not copied.
grpc::ByteBuffer relayRequestOf(const v1::RelayRequest& relay, const grpc::Slice& common) {
  std::string head;
  relay.SerializeToString(&head);
  if (common.size() == 0) return bufferOf(head);
  constexpr uint32_t kCommonRequestField = v1::RelayRequest::kCommonRequestFieldNumber;
  static_assert(kCommonRequestField < 16, "a one-byte tag");
  head.push_back(static_cast<char>(kCommonRequestField << 3 | 2));  // (a length-delimited field)
  for (uint64_t n = common.size();; n >>= 7) {                      // its length, a varint
    if (n < 0x80) {
      head.push_back(static_cast<char>(n));
      break;
    }
    head.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  grpc::Slice slices[] = {grpc::Slice(head), common};
  return grpc::ByteBuffer(slices, 2);
}

std::string stringOf(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buffer.Dump(&slices).ok()) return out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

bool isFailure(const grpc::Status& st) { return !st.ok() && st.error_code() != grpc::StatusCode::CANCELLED; }

// One outgoing call: a call to one daemon, or a Relay for the calls [begin, end).
struct Outgoing {
  size_t begin = 0, end = 0;
  bool relayed = false;
  grpc::ByteBuffer request, response;
};

}  // namespace

grpc::Status parseResult(const RawResult& result, google::protobuf::Message* out) {
  if (result.status.ok() && !out->ParseFromString(result.response))
    return grpc::Status(grpc::StatusCode::INTERNAL, "a daemon answered with a malformed response");
  return result.status;
}

std::vector<std::pair<size_t, size_t>> relayGroups(size_t n, uint32_t fanout) {
  std::vector<std::pair<size_t, size_t>> out;
  if (n == 0) return out;
  const size_t groups = fanout == 0 || n <= fanout ? n : fanout;
  for (size_t g = 0, begin = 0; g < groups; ++g) {
    const size_t size = n / groups + (g < n % groups ? 1 : 0);
    out.emplace_back(begin, begin + size);
    begin += size;
  }
  return out;
}

int relayDepth(size_t m, uint32_t fanout) {
  if (m <= 1 || fanout == 0 || m - 1 <= fanout) return 0;
  size_t largest = 0;
  for (const auto& [b, e] : relayGroups(m - 1, fanout)) largest = std::max(largest, e - b);
  return 1 + relayDepth(largest, fanout);
}

namespace {

// What goes out for `n` calls: calls[0] alone (first_here), then one entry per subtree of the rest.
std::deque<Outgoing> outgoingOf(size_t n, uint32_t fanout, bool first_here) {
  std::deque<Outgoing> out;
  const size_t skip = first_here ? 1 : 0;
  if (first_here) {
    out.emplace_back();
    out.back().begin = 0;
    out.back().end = 1;
  }
  for (const auto& [b, e] : relayGroups(n - skip, fanout)) {
    out.emplace_back();
    out.back().begin = b + skip;
    out.back().end = e + skip;
    out.back().relayed = e - b > 1;
  }
  return out;
}

// Starts one outgoing call: to its daemon, or a Relay of its calls to the first of them. Its
// deadline is its own (a relay's: its calls' longest, plus a margin per hop below it).
// `common`: options.common_request, one slice for every call.
void startOutgoing(const PeerSet& peers, const std::vector<RawCall>& calls, const TreeOptions& options,
                   const grpc::Slice& common, Outgoing& o, grpc::ClientContext& context, CallDone done,
                   std::chrono::system_clock::time_point now) {
  const RawCall& head = calls[o.begin];
  auto channel = peers.channel(head.address);
  if (!o.relayed) {
    context.set_deadline(now + head.timeout);
    o.request = requestOf(common, head.request);
    grpc::GenericStub(channel).UnaryCall(&context, path(options.method), grpc::StubOptions(), &o.request, &o.response,
                                         std::move(done));
    return;
  }
  v1::RelayRequest r;
  r.set_method(options.method);
  r.set_fanout(options.fanout);
  r.set_stop_at_failure(options.stop_at_failure);
  std::chrono::milliseconds longest{0};
  for (size_t i = o.begin; i < o.end; ++i) {
    auto* c = r.add_calls();
    c->set_address(calls[i].address);
    c->set_request(calls[i].request);
    c->set_timeout_ms(
        static_cast<uint32_t>(std::clamp<int64_t>(calls[i].timeout.count(), 0, std::numeric_limits<uint32_t>::max())));
    longest = std::max(longest, calls[i].timeout);
  }
  context.set_deadline(now + longest + kHopMargin * (1 + relayDepth(o.end - o.begin, options.fanout)));
  o.request = relayRequestOf(r, common);
  grpc::GenericStub(channel).UnaryCall(&context, "/shardcast.v1.Peer/Relay", grpc::StubOptions(), &o.request,
                                       &o.response, std::move(done));
}

// Unpacks one finished outgoing call into results[begin, end); true when one of them failed.
bool unpackOutgoing(Outgoing& o, grpc::Status status, const std::vector<RawCall>& calls,
                    std::vector<RawResult>& results) {
  if (!o.relayed) {
    results[o.begin].status = status;
    if (status.ok()) results[o.begin].response = stringOf(o.response);
    return isFailure(status);
  }
  v1::RelayResponse rr;
  if (status.ok() &&
      (!rr.ParseFromString(stringOf(o.response)) || static_cast<size_t>(rr.results_size()) != o.end - o.begin))
    status = grpc::Status(grpc::StatusCode::INTERNAL, "a relay answered with a malformed response");
  if (!status.ok()) {
    // The relay itself failed: it is named for its own call; the rest were not reached through it.
    results[o.begin].status = status;
    for (size_t i = o.begin; i < o.end; ++i) results[i].unconfirmed = true;
    for (size_t i = o.begin + 1; i < o.end; ++i)
      results[i].status = grpc::Status(
          grpc::StatusCode::CANCELLED,
          strCat("not reached: relayed through ", calls[o.begin].address, ", which failed: ", status.error_message()));
    return isFailure(status);
  }
  bool failed = false;
  for (size_t i = o.begin; i < o.end; ++i) {
    auto& got = *rr.mutable_results(static_cast<int>(i - o.begin));
    results[i].status = grpc::Status(static_cast<grpc::StatusCode>(got.code()), got.message(), got.details());
    const auto code = results[i].status.error_code();
    results[i].unconfirmed = code == grpc::StatusCode::DEADLINE_EXCEEDED || code == grpc::StatusCode::UNAVAILABLE ||
                             code == grpc::StatusCode::CANCELLED;
    if (results[i].status.ok()) results[i].response = std::move(*got.mutable_response());
    failed = failed || isFailure(results[i].status);
  }
  return failed;
}

}  // namespace

std::vector<RawResult> callTree(const PeerSet& peers, const std::vector<RawCall>& calls, const TreeOptions& options,
                                const std::function<void(size_t, const RawResult&)>& each, bool first_here) {
  const size_t n = calls.size();
  std::vector<RawResult> results(n);
  if (n == 0) return results;
  std::deque<Outgoing> out = outgoingOf(n, options.fanout, first_here);
  // Each outgoing call through fanOut, the one way daemons call each other: its context tracked for
  // the caller's cancelling.
  std::vector<grpc::ClientContext> contexts(out.size());
  const auto now = std::chrono::system_clock::now();
  const grpc::Slice common(options.common_request);  // one copy, referenced by every call
  bool stop = false;  // a failure with stop_at_failure: the calls still in flight are cancelled
  fanOut(
      contexts, now + std::chrono::hours(24 * 365),
      [&](size_t k, grpc::ClientContext& context, CallDone done) {
        if (options.track) options.track(context, true);
        startOutgoing(peers, calls, options, common, out[k], context, std::move(done), now);
      },
      [&](size_t k, const grpc::Status& status) {
        const bool failed = unpackOutgoing(out[k], status, calls, results);
        if (each)
          for (size_t i = out[k].begin; i < out[k].end; ++i) each(i, results[i]);
        stop = stop || (failed && options.stop_at_failure);
      },
      [&] { return stop || (options.cancelled && options.cancelled()); });
  if (options.track)
    for (auto& c : contexts) options.track(c, false);
  return results;
}

std::vector<RawResult> callTreeReachingAll(const PeerSet& peers, const std::vector<RawCall>& calls, TreeOptions options,
                                           std::chrono::milliseconds first_timeout, size_t* again) {
  options.stop_at_failure = false;
  options.cancelled = nullptr;
  options.track = nullptr;
  // Only calls that go through a relay get the shorter first timeout (they are sent again);
  // a direct call has its own timeout once.
  std::vector<RawCall> first = calls;
  for (const auto& [b, e] : relayGroups(first.size(), options.fanout))
    if (e - b > 1)
      for (size_t i = b; i < e; ++i) first[i].timeout = std::min(first[i].timeout, first_timeout);
  auto results = callTree(peers, first, options);
  std::vector<RawCall> unreached;
  std::vector<size_t> at;
  for (size_t i = 0; i < results.size(); ++i)
    if (results[i].unconfirmed) {
      unreached.push_back(calls[i]);
      at.push_back(i);
    }
  if (again) *again = unreached.size();
  if (unreached.empty()) return results;
  options.fanout = 0;  // directly
  auto retried = callTree(peers, unreached, options);
  for (size_t k = 0; k < at.size(); ++k) results[at[k]] = std::move(retried[k]);
  return results;
}

StatusOr<v1::RelayResponse> relay(const PeerSet& peers, const v1::RelayRequest& request,
                                  std::chrono::system_clock::time_point deadline,
                                  const std::function<bool()>& cancelled) {
  if (!knownMethod(request.method()))
    return absl::InvalidArgumentError(strCat("relay: no Peer method ", quote(request.method()), " is relayed"));
  if (request.fanout() < 2) return absl::InvalidArgumentError("relay: fanout must be at least 2");
  if (request.calls_size() == 0 || static_cast<size_t>(request.calls_size()) > kMaxRelayCalls)
    return absl::InvalidArgumentError(
        strCat("relay: between 1 and ", kMaxRelayCalls, " calls, not ", request.calls_size()));
  // A caller that set no deadline would have this daemon hold its calls (and a thread) for as long
  // as the calls' own timeouts say: up to 49 days each.
  if (deadline == std::chrono::system_clock::time_point::max())
    return absl::InvalidArgumentError("relay: a Relay needs a deadline");
  // The calls end in time for this relay to answer before its own deadline: a margin per hop
  // below it (the sub-relays' own margins) and one for its answer. Else, delivered late, it would
  // time out at its caller with its calls, and be named for a daemon silent below it.
  const auto reserve = kHopMargin * (1 + relayDepth(static_cast<size_t>(request.calls_size()), request.fanout()));
  const auto left = std::max(
      std::chrono::milliseconds(0),
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::system_clock::now()) - reserve);
  std::vector<RawCall> calls;
  calls.reserve(static_cast<size_t>(request.calls_size()));
  std::set<std::string_view> seen;
  for (const auto& c : request.calls()) {
    // Only to the cluster's daemons: a relay is no proxy to anywhere else.
    if (!peers.isPeer(c.address()))
      return absl::PermissionDeniedError(strCat("relay: ", quote(c.address()), " is not a peer of this daemon"));
    // Each daemon once: a coordinator calls each daemon once per phase, and a request naming one
    // daemon thousands of times would make this relay a flood towards it.
    if (!seen.insert(c.address()).second)
      return absl::InvalidArgumentError(strCat("relay: ", quote(c.address()), " is called more than once"));
    calls.push_back({c.address(), c.request(), std::min(left, std::chrono::milliseconds(c.timeout_ms()))});
  }
  TreeOptions options;
  options.method = request.method();
  options.fanout = request.fanout();
  options.stop_at_failure = request.stop_at_failure();
  options.common_request = request.common_request();
  options.cancelled = cancelled;
  auto results = callTree(peers, calls, options, nullptr, /*first_here=*/true);
  v1::RelayResponse out;
  for (auto& r : results) {
    auto* got = out.add_results();
    got->set_code(static_cast<int32_t>(r.status.error_code()));
    got->set_message(r.status.error_message());
    got->set_details(r.status.error_details());
    got->set_response(std::move(r.response));
  }
  return out;
}

}  // namespace shardcast::daemon

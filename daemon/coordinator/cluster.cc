#include "daemon/coordinator/cluster.h"

#include <netdb.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <limits>
#include <thread>
#include <tuple>

#include "common/strings.h"
#include "common/tls.h"
#include "daemon/registry/registry.h"
#include "daemon/server/ucx_admission.h"

namespace shardcast::daemon {

PeerSet::PeerSet(const DaemonConfig& config, std::string instance) : config_(config), instance_(std::move(instance)) {}

StatusOr<std::vector<std::string>> PeerSet::addresses() const {
  std::vector<std::string> out = config_.peers;
  if (!config_.peer_dns.empty()) {
    const auto colon = config_.peer_dns.rfind(':');
    const std::string host = config_.peer_dns.substr(0, colon), port = config_.peer_dns.substr(colon + 1);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
    if (rc != 0)
      return absl::UnavailableError(strCat("resolving peers \"", config_.peer_dns, "\": ", gai_strerror(rc)));
    for (addrinfo* a = res; a; a = a->ai_next) {
      char ip[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, ip, sizeof(ip), nullptr, 0, NI_NUMERICHOST) != 0) continue;
      const std::string s = a->ai_family == AF_INET6 ? strCat("[", ip, "]:", port) : strCat(ip, ":", port);
      out.push_back(s);
    }
    ::freeaddrinfo(res);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  std::lock_guard<std::mutex> lock(mu_);
  current_ = out;
  current_at_ = std::chrono::steady_clock::now();
  return out;
}

bool PeerSet::isPeer(const std::string& address) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (std::find(current_.begin(), current_.end(), address) != current_.end()) return true;
    if (current_at_ != std::chrono::steady_clock::time_point{} &&
        std::chrono::steady_clock::now() - current_at_ < std::chrono::seconds(1))
      return false;
  }
  const auto all = addresses();
  return all.ok() && std::find(all->begin(), all->end(), address) != all->end();
}

std::shared_ptr<grpc::Channel> PeerSet::channel(const std::string& address) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto& ch = channels_[address];
  if (!ch) {
    // A restarted peer must be reached at once, not after gRPC's reconnect backoff (1 s doubling
    // to 120 s by default): a sync retried after a restart would fail "unavailable" meanwhile.
    // gRPC's "min reconnect backoff" is the least time a connection attempt (TCP, TLS handshake,
    // HTTP/2 settings) is given: at 100 ms, 64 daemons starting on 2 cores failed their first
    // handshakes ("timed out before receiving SETTINGS frame"), so attempts get the call deadline.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, std::clamp(config_.peer_timeout_ms, 1000, 20000));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetMaxReceiveMessageSize(std::numeric_limits<int>::max());  // a Describe of the largest legal layouts
    // Not gRPC's process-wide subchannel pool: a channel made anew after a peer restarted must not
    // inherit a connection to the old process.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    ch = grpc::CreateCustomChannel(address, channelCredentials(config_.tls, &args), args);
  }
  return ch;
}

std::map<std::string, std::string> PeerSet::knownNodes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return nodes_;
}

std::vector<grpc::Status> fanOut(std::vector<grpc::ClientContext>& contexts,
                                 std::chrono::system_clock::time_point deadline,
                                 const std::function<void(size_t, grpc::ClientContext&, CallDone)>& start,
                                 const std::function<void(size_t, const grpc::Status&)>& each,
                                 const std::function<bool()>& cancel_when) {
  const size_t n = contexts.size();
  std::vector<grpc::Status> results(n);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<size_t> completed;  // not yet handed to `each`
  size_t pending = n;
  for (auto& c : contexts) c.set_deadline(deadline);
  for (size_t i = 0; i < n; ++i)
    start(i, contexts[i], [&, i](grpc::Status st) {
      std::lock_guard<std::mutex> lock(mu);
      results[i] = std::move(st);
      completed.push_back(i);
      --pending;
      cv.notify_all();
    });
  bool cancelled = false;
  std::unique_lock<std::mutex> lock(mu);
  while (true) {
    const auto ready = [&] { return pending == 0 || (each && !completed.empty()); };
    if (cancel_when && !cancelled)
      cv.wait_for(lock, std::chrono::milliseconds(20), ready);
    else
      cv.wait(lock, ready);
    std::vector<size_t> now;
    now.swap(completed);
    const bool last = pending == 0;
    lock.unlock();
    if (each)
      for (const size_t i : now) each(i, results[i]);  // a completed call's status no longer changes
    if (cancel_when && !cancelled && !last && cancel_when()) {
      cancelled = true;
      for (auto& c : contexts) c.TryCancel();
    }
    lock.lock();
    if (last && completed.empty()) break;
  }
  return results;
}

void CallSet::track(grpc::ClientContext& context, bool add) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!add) {
    calls_.erase(&context);
    return;
  }
  if (cancelled_) context.TryCancel();
  calls_.insert(&context);
}

bool CallSet::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_) return false;
  cancelled_ = true;
  for (auto* c : calls_) c->TryCancel();
  return true;
}

Status PeerSet::checkTransportAddresses(const std::vector<NodeAddress>& nodes,
                                        std::chrono::steady_clock::time_point deadline,
                                        const std::function<bool()>& cancelled) const {
  const auto unconfirmed = [&] {  // the nodes not known to have the transport address given
    std::vector<const NodeAddress*> out;
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& n : nodes)
      if (const auto it = transports_.find(n.node); it == transports_.end() || it->second != n.transport)
        out.push_back(&n);
    return out;
  };
  auto pending = unconfirmed();
  std::string last_error;  // of the last Describe that got no answer
  auto pause = std::chrono::milliseconds(20);
  Everywhere everywhere;  // a node known nowhere: every peer asked, once
  // Never longer than a few peer timeouts, whatever the call's deadline (a first sync's Prepare has
  // the sync's whole timeout): a node silent that long is refused by name.
  deadline = std::min(deadline, std::chrono::steady_clock::now() +
                                    4 * std::chrono::milliseconds(std::max(config_.peer_timeout_ms, 1000)));
  while (!pending.empty()) {
    if (cancelled && cancelled()) return absl::CancelledError("the call checking transport addresses ended");
    // Addresses another check is asking now are not asked again: what that round learns is
    // recorded as each answer comes (at a first sync every daemon asks about its peers at once),
    // and a silent one holds up only the check that asked it.
    const std::vector<std::string> ask = whereToAsk(pending, &everywhere);
    if (!ask.empty()) {
      std::vector<v1::DescribeResponse> responses;
      v1::DescribeRequest request;  // (the node and its transport address are all this needs)
      request.set_layout_digests(true);
      const auto statuses = describe(ask, &responses, request, {}, deadline);
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& a : ask) asking_.erase(a);
      }
      for (size_t i = 0; i < ask.size(); ++i) {
        if (!statuses[i].ok()) {
          last_error = strCat("peer ", ask[i], ": ", statuses[i].error_message());
          continue;
        }
        // The node's own answer (over mutual TLS) with another address: refused at once.
        for (const NodeAddress* p : pending)
          if (responses[i].node() == p->node && responses[i].transport_address() != p->transport)
            return absl::InvalidArgumentError(strCat("the transport address given for node ", quote(p->node),
                                                     " is not the one that node describes to this daemon"));
      }
    }
    pending = unconfirmed();
    if (pending.empty()) break;
    // Not answered yet (slow, starting, or asked moments ago by another round): asked again.
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      std::vector<std::string> names;
      for (const NodeAddress* p : pending) names.push_back(quote(p->node));
      const bool one = names.size() == 1;
      return absl::UnavailableError(
          strCat(one ? "node " : "nodes ", strJoin(names, ", "),
                 one ? " has not described itself" : " have not described themselves",
                 " to this daemon in time: ", one ? "its transport address" : "their transport addresses",
                 " cannot be checked", last_error.empty() ? std::string() : strCat(" (", last_error, ")")));
    }
    std::this_thread::sleep_until(std::min(now + pause, deadline));
    pause = std::min(pause * 2, kAskEvery);
  }
  return absl::OkStatus();
}

std::vector<std::string> PeerSet::whereToAsk(const std::vector<const NodeAddress*>& pending,
                                             Everywhere* everywhere) const {
  // A node is asked at its daemon's address as given (when that is one of the cluster's peers: no
  // other address is dialled) and wherever it was reached before or a peer said it is.
  std::vector<bool> given(pending.size());
  for (size_t k = 0; k < pending.size(); ++k) given[k] = !pending[k]->address.empty() && isPeer(pending[k]->address);
  std::set<std::string> where;
  bool nowhere = false;  // a node no address is known for
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t k = 0; k < pending.size(); ++k) {
      bool placed = given[k];
      if (given[k]) where.insert(pending[k]->address);
      for (const auto& [a, n] : nodes_)
        if (n == pending[k]->node) {
          where.insert(a);
          placed = true;
        }
      nowhere = nowhere || !placed;
    }
  }
  const bool first_look = nowhere && everywhere->first;
  if (first_look) everywhere->first = false;
  // Else the peers not described yet; when none is left, every peer (a node renamed, or back at
  // another's address). The peer list (a DNS lookup with --peer-dns) looked up at most once a second.
  std::vector<std::string> all;
  if (first_look) {
    bool look_up = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      look_up = current_at_ == std::chrono::steady_clock::time_point{} ||
                std::chrono::steady_clock::now() - current_at_ >= std::chrono::seconds(1);
      all = current_;
    }
    if (look_up)
      if (auto found = addresses(); found.ok()) all = std::move(*found);
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  std::vector<std::string> ask;
  // At most once per kAskEvery, whoever asks, and not while another check's round asks it; true
  // when taken.
  const auto take = [&](const std::string& a) {
    if (asking_.count(a)) return false;
    auto [asked, added] = looked_up_.try_emplace(a, now);
    if (!added && now - asked->second < kAskEvery) return false;
    asked->second = now;
    asking_.insert(a);
    ask.push_back(a);
    return true;
  };
  for (const auto& a : where) take(a);
  if (first_look) {
    const bool undescribed =
        std::any_of(all.begin(), all.end(), [&](const std::string& a) { return !nodes_.count(a); });
    for (const auto& a : all)
      if ((!undescribed || !nodes_.count(a)) && !take(a)) everywhere->left.insert(a);
  } else if (nowhere) {
    // The addresses of that one look that another round was asking then (or had just asked):
    // asked by this check once they are free.
    for (auto it = everywhere->left.begin(); it != everywhere->left.end();)
      it = take(*it) ? everywhere->left.erase(it) : std::next(it);
  }
  return ask;
}

bool PeerSet::forgottenLocked(const std::string& address, std::chrono::steady_clock::time_point now) const {
  const auto since = silent_since_.find(address);
  return config_.peer_lease_ms > 0 && since != silent_since_.end() &&
         now - since->second >= std::chrono::milliseconds(config_.peer_lease_ms);
}

void PeerSet::forgetSilence() const {
  std::lock_guard<std::mutex> lock(mu_);
  silent_since_.clear();
}

void PeerSet::noteSilent(const std::string& address, std::chrono::steady_clock::time_point asked) const {
  std::lock_guard<std::mutex> lock(mu_);
  answered_[address] = false;
  silent_since_.emplace(address, asked);
}

std::vector<grpc::Status> PeerSet::describe(const std::vector<std::string>& addrs,
                                            std::vector<v1::DescribeResponse>* responses,
                                            const v1::DescribeRequest& request,
                                            const std::map<std::string, std::chrono::milliseconds>& briefly,
                                            std::chrono::steady_clock::time_point until) const {
  // Every Describe at once: a gather costs about one round trip however many peers there are.
  const size_t n = addrs.size();
  responses->assign(n, {});
  std::vector<grpc::ClientContext> contexts(n);
  std::vector<bool> forgotten(n, false);                // asked briefly: one that is back answers at once
  const auto asked = std::chrono::steady_clock::now();  // a peer that fails was silent from here
  const auto deadline = describeDeadlines(addrs, briefly, until, asked, &forgotten);
  // What each peer says of itself is known as soon as it answers: a check waiting on another
  // caller's round (checkTransportAddresses) does not wait for that round's slowest peer.
  const auto learn = [&](size_t i, grpc::ClientContext& context, const grpc::Status& st) {
    if (!st.ok()) return;
    // It answered over the authenticated control plane: its UCX connections come from there.
    UcxAdmission::instance().notePeer(context.peer());
    std::lock_guard<std::mutex> lock(mu_);
    nodes_[addrs[i]] = (*responses)[i].node();
    transports_[(*responses)[i].node()] = (*responses)[i].transport_address();
  };
  auto statuses = fanOut(
      contexts, std::chrono::system_clock::now() + std::chrono::milliseconds(config_.peer_timeout_ms),
      [&](size_t i, grpc::ClientContext& c, CallDone done) {
        c.set_deadline(std::chrono::system_clock::now() + deadline[i]);
        v1::Peer::NewStub(channel(addrs[i]))->async()->Describe(&c, &request, &(*responses)[i], std::move(done));
      },
      [&](size_t i, const grpc::Status& st) { learn(i, contexts[i], st); });
  // A channel to a peer that restarted within the last second may still be backing off from the
  // calls that failed while it was down: gRPC then fails a call at once, UNAVAILABLE, without
  // trying. Ask those once more on a fresh channel (a peer that is really down refuses again, as
  // fast). A relay checking a restarted node's new transport address failed a sync this way.
  std::vector<size_t> again;
  for (size_t i = 0; i < n; ++i)
    if (statuses[i].error_code() == grpc::StatusCode::UNAVAILABLE) again.push_back(i);
  if (!again.empty()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i : again) channels_.erase(addrs[i]);
    }
    std::vector<grpc::ClientContext> retry_contexts(again.size());
    const auto retried = fanOut(
        retry_contexts, std::chrono::system_clock::now() + std::chrono::milliseconds(config_.peer_timeout_ms),
        [&](size_t k, grpc::ClientContext& c, CallDone done) {
          const size_t i = again[k];
          c.set_deadline(std::chrono::system_clock::now() + deadline[i]);
          v1::Peer::NewStub(channel(addrs[i]))->async()->Describe(&c, &request, &(*responses)[i], std::move(done));
        },
        [&](size_t k, const grpc::Status& st) { learn(again[k], retry_contexts[k], st); });
    for (size_t k = 0; k < again.size(); ++k) statuses[again[k]] = retried[k];
  }
  noteAnswers(addrs, *responses, statuses, forgotten, asked);
  return statuses;
}

std::vector<std::chrono::milliseconds> PeerSet::describeDeadlines(
    const std::vector<std::string>& addrs, const std::map<std::string, std::chrono::milliseconds>& briefly,
    std::chrono::steady_clock::time_point until, std::chrono::steady_clock::time_point asked,
    std::vector<bool>* forgotten) const {
  std::vector<std::chrono::milliseconds> deadline(addrs.size(), std::chrono::milliseconds(config_.peer_timeout_ms));
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < addrs.size(); ++i) {
    (*forgotten)[i] = forgottenLocked(addrs[i], asked);
    if ((*forgotten)[i]) deadline[i] = std::min(deadline[i], std::chrono::milliseconds(100));
    if (const auto node = nodes_.find(addrs[i]); node != nodes_.end())
      if (const auto brief = briefly.find(node->second); brief != briefly.end())
        deadline[i] = std::min(deadline[i], brief->second);
    if (until != std::chrono::steady_clock::time_point::max())
      deadline[i] = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(until - asked),
                               std::chrono::milliseconds(1), deadline[i]);
  }
  return deadline;
}

void PeerSet::noteAnswers(const std::vector<std::string>& addrs, const std::vector<v1::DescribeResponse>& responses,
                          const std::vector<grpc::Status>& statuses, const std::vector<bool>& forgotten,
                          std::chrono::steady_clock::time_point asked) const {
  const size_t n = addrs.size();
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; ++i) {
    answered_[addrs[i]] = statuses[i].ok();
    if (statuses[i].ok()) {
      if (silent_since_.erase(addrs[i]) && forgotten[i])
        spdlog::info("peer {} answers again: it takes part in syncs", addrs[i]);
    } else {
      silent_since_.emplace(addrs[i], asked);
      if (!forgotten[i] && forgottenLocked(addrs[i], now)) {
        const auto node = nodes_.find(addrs[i]);
        spdlog::warn("peer {}{} silent for {} ms, past its lease (--peer-lease-ms): forgotten until it answers again",
                     addrs[i], node == nodes_.end() ? "" : strCat(" (node \"", node->second, "\")"),
                     config_.peer_lease_ms);
      }
    }
    const grpc::StatusCode code = statuses[i].error_code();
    // A fresh channel next time: a restarted peer is then reached without reconnect backoff.
    if (code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) channels_.erase(addrs[i]);
  }
  // What the others know of peers this daemon never reached.
  for (size_t i = 0; i < n; ++i)
    if (statuses[i].ok())
      for (const auto& [address, node] : responses[i].peer_nodes()) nodes_.emplace(address, node);
}

StatusOr<std::vector<PeerSet::PeerView>> PeerSet::describeAll(const v1::DescribeRequest& request,
                                                              const Ask& ask) const {
  const auto& skip = ask.skip;
  SC_ASSIGN_OR_RETURN(auto addrs, addresses());
  const size_t n = addrs.size();
  std::vector<std::string> asked;  // the addresses not skipped, and where each is in addrs
  std::vector<size_t> at;
  std::vector<grpc::Status> statuses(n);
  for (size_t i = 0; i < n; ++i) {
    std::string left_out;
    if (!skip.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto node = nodes_.find(addrs[i]); node != nodes_.end())
        if (auto why = skip.find(node->second); why != skip.end()) left_out = why->second;
    }
    if (left_out.empty()) {
      asked.push_back(addrs[i]);
      at.push_back(i);
    } else {
      statuses[i] = grpc::Status(grpc::StatusCode::UNAVAILABLE, strCat("not asked: ", left_out));
    }
  }
  std::vector<v1::DescribeResponse> answers, responses(n);
  const auto answered = describe(asked, &answers, request, ask.briefly);
  for (size_t j = 0; j < at.size(); ++j) {
    statuses[at[j]] = answered[j];
    responses[at[j]] = std::move(answers[j]);
  }
  std::vector<PeerView> out;
  std::set<std::string> seen{instance_};
  for (size_t i = 0; i < n; ++i) {
    const std::string& address = addrs[i];
    const grpc::Status& st = statuses[i];
    // Ourselves listed among the peers, or one daemon under two addresses (IPv4 and IPv6): the
    // same instance. Another daemon with our node name is a different instance: ClusterView
    // refuses the pair.
    if (st.ok() && !seen.insert(responses[i].instance()).second) continue;
    std::string known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = nodes_.find(address); it != nodes_.end()) known = strCat(" (node \"", it->second, "\")");
    }
    bool forgotten = false;
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      forgotten = forgottenLocked(address, std::chrono::steady_clock::now());
    }
    out.push_back({address,
                   st.ok() ? StatusOr<v1::DescribeResponse>(std::move(responses[i]))
                           : StatusOr<v1::DescribeResponse>(fromGrpc(st, strCat("peer ", address, known))),
                   forgotten});
  }
  return out;
}

std::map<std::string, bool> PeerSet::reachability() const {
  bool stale = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stale = std::chrono::steady_clock::now() - current_at_ > std::chrono::seconds(30);
  }
  // A daemon that coordinates nothing still follows --peer-dns (pods restarted with new addresses).
  if (stale) static_cast<void>(addresses());  // a failed lookup leaves the last peers
  std::map<std::string, std::string> nodes;
  std::map<std::string, bool> answered;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& address : current_)  // a peer gone from --peer-dns is no longer reported
      if (const auto it = nodes_.find(address); it != nodes_.end()) nodes.insert(*it);
    answered = answered_;
  }
  std::map<std::string, bool> out;
  for (const auto& [address, node] : nodes) {
    if (node == config_.node) continue;  // this daemon, listed among its own peers
    const grpc_connectivity_state state = channel(address)->GetState(/*try_to_connect=*/true);
    const auto last = answered.find(address);
    const bool up = state == GRPC_CHANNEL_READY || ((state == GRPC_CHANNEL_IDLE || state == GRPC_CHANNEL_CONNECTING) &&
                                                    last != answered.end() && last->second);
    // One daemon under two addresses (IPv4 and IPv6) is up when either reaches it.
    out[node] = out[node] || up;
  }
  return out;
}

void PeerSet::fetchLayouts(const std::vector<std::string>& addrs, const std::vector<std::set<LayoutKey>>& wanted,
                           std::chrono::system_clock::time_point deadline,
                           std::map<LayoutKey, std::shared_ptr<const v1::Layout>>* found) const {
  std::vector<v1::DescribeRequest> requests(addrs.size());
  std::vector<v1::DescribeResponse> responses(addrs.size());
  for (size_t i = 0; i < addrs.size(); ++i)
    for (const auto& [group, digest] : wanted[i]) requests[i].add_layouts(digest);
  std::vector<grpc::ClientContext> contexts(addrs.size());
  const auto statuses = fanOut(contexts, deadline, [&](size_t i, grpc::ClientContext& c, CallDone done) {
    c.set_deadline(deadline);
    v1::Peer::NewStub(channel(addrs[i]))->async()->Describe(&c, &requests[i], &responses[i], std::move(done));
  });
  for (size_t i = 0; i < addrs.size(); ++i) {
    if (!statuses[i].ok()) {
      spdlog::warn("peer {}: its layouts could not be fetched: {}", addrs[i], statuses[i].error_message());
      continue;
    }
    // Each checked: a daemon sends only layouts it was asked for (an older one sends all).
    for (auto& layout : *responses[i].mutable_layouts())
      if (LayoutKey key{layout.group(), planner::layoutDigest(layout)}; wanted[i].count(key) && !found->count(key))
        found->emplace(std::move(key), std::make_shared<const v1::Layout>(std::move(layout)));
  }
}

GatheredLayouts PeerSet::layoutsOf(const v1::DescribeResponse& self, const std::vector<PeerView>& peers) const {
  GatheredLayouts out;
  auto& found = out.found;
  // Named by digest, each with the first node naming it and the peers naming it (indexes, in order).
  struct Named {
    std::string node;
    std::vector<size_t> holders;
  };
  std::map<LayoutKey, Named> named;
  const auto take = [&](const v1::DescribeResponse& d, std::optional<size_t> peer) {
    for (const auto& layout : d.layouts()) {  // sent whole (this daemon, or a daemon of an older version)
      auto& at = found[{layout.group(), planner::layoutDigest(layout)}];
      if (!at) at = std::make_shared<const v1::Layout>(layout);
    }
    for (const auto& [group, digest] : d.layout_digests()) {
      auto& n = named.try_emplace({group, digest}, Named{d.node(), {}}).first->second;
      if (peer) n.holders.push_back(*peer);
    }
  };
  take(self, std::nullopt);
  for (size_t i = 0; i < peers.size(); ++i)
    if (peers[i].described.ok()) take(*peers[i].described, i);
  {
    std::lock_guard<std::mutex> lock(mu_);  // kept from the last gather
    for (const auto& [key, n] : named)
      if (const auto kept = layouts_.find(key); kept != layouts_.end()) found.insert(*kept);
  }
  // Each layout still missing asked of its next holder, all holders at once, until every one is
  // found or has no holder left to ask; all within one peer timeout (a holder that answered the
  // gather but not this costs that, not a timeout per holder).
  const auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(config_.peer_timeout_ms);
  std::map<LayoutKey, size_t> tried;  // holders asked so far
  while (true) {
    std::map<size_t, std::set<LayoutKey>> asks;  // peer -> what it is asked for
    for (const auto& [key, n] : named) {
      size_t& next = tried[key];
      if (found.count(key) || next == n.holders.size()) continue;
      asks[n.holders[next++]].insert(key);
    }
    if (asks.empty() || std::chrono::system_clock::now() >= deadline) break;
    std::vector<std::string> addrs;
    std::vector<std::set<LayoutKey>> wanted;
    for (auto& [peer, keys] : asks) {
      addrs.push_back(peers[peer].address);
      wanted.push_back(std::move(keys));
    }
    fetchLayouts(addrs, wanted, deadline, &found);
  }
  // Kept for the next gather: what this one named and found (a layout no daemon names any more goes).
  std::map<LayoutKey, std::shared_ptr<const v1::Layout>> keep;
  for (const auto& [key, n] : named) {
    if (const auto it = found.find(key); it != found.end()) {
      keep.insert(*it);
      continue;
    }
    out.missing[key] =
        strCat("the layout of group ", quote(key.first), " (digest ", key.second, ") on node ", quote(n.node),
               " could not be fetched from ",
               n.holders.size() == 1 ? std::string("the daemon") : strCat("any of the ", n.holders.size(), " daemons"),
               " naming it (", tried[key],
               " asked): a registration changed since the gather, a daemon stopped "
               "answering, or one sent another layout");
  }
  std::lock_guard<std::mutex> lock(mu_);
  layouts_ = std::move(keep);
  return out;
}

StatusOr<ClusterSnapshot> snapshotCluster(const PeerSet& peers, const v1::DescribeResponse& self,
                                          const std::string& self_address, std::vector<std::string>* unreachable,
                                          const PeerSet::Ask& ask) {
  // Each group's layout named by its digest, and fetched once (layoutsOf): a layout gathered from
  // every daemon holding it cost a coordinator seconds and gigabytes at a 1T MoE's 71,000 tensors.
  // A layout no daemon sent (registrations changed between the two calls) is asked for again with
  // a new gather, once; then its group fails its syncs and the others go on.
  v1::DescribeRequest request;
  request.set_layout_digests(true);
  constexpr int kTries = 2;
  for (int attempt = 1;; ++attempt) {
    SC_ASSIGN_OR_RETURN(auto described, peers.describeAll(request, ask));
    // Peers silent past their lease are not waited for, and fail nothing: the cluster is the others.
    described.erase(std::remove_if(described.begin(), described.end(), [](const auto& p) { return p.forgotten; }),
                    described.end());
    auto layouts = peers.layoutsOf(self, described);
    if (!layouts.missing.empty() && attempt < kTries) continue;
    for (auto& [key, why] : layouts.missing) why = strCat(why, " (", kTries, " gathers in a row)");
    std::vector<std::string> addresses{self_address};
    for (const auto& p : described)
      if (p.described.ok()) addresses.push_back(p.address);  // the view's daemons, in its order
    SC_ASSIGN_OR_RETURN(auto view, ClusterView::build(self, std::move(described), layouts, unreachable));
    return ClusterSnapshot{std::move(view), std::move(addresses)};
  }
}

std::string rankRanges(const std::vector<int32_t>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? std::to_string(ranks[i]) : strCat(ranks[i], "-", ranks[j]);
    i = j + 1;
  }
  return out;
}

const v1::Layout& ClusterView::GroupInfo::get() const {
  static const v1::Layout kNone;
  return layout ? *layout : kNone;
}

StatusOr<ClusterView> ClusterView::build(const v1::DescribeResponse& self, std::vector<PeerSet::PeerView> peers,
                                         const GatheredLayouts& layouts, std::vector<std::string>* unreachable) {
  ClusterView v;
  v.daemons_.push_back(self);
  for (auto& p : peers) {
    if (!p.described.ok()) {
      std::string why = strCat("peer daemon ", p.address, " is unreachable: ", p.described.status().message());
      if (unreachable == nullptr) return absl::UnavailableError(why);
      unreachable->push_back(std::move(why));
      continue;
    }
    v.daemons_.push_back(std::move(*p.described));
  }
  // One group's layout as a daemon named it: the first node's stays, another digest fails the group.
  const auto addLayout = [&](const std::string& group, const std::string& digest, const std::string& node,
                             std::shared_ptr<const v1::Layout> layout) {
    GroupInfo first;
    first.layout = std::move(layout);
    first.digest = digest;
    auto [it, inserted] = v.groups_.try_emplace(group, std::move(first));
    if (!inserted && it->second.digest.empty()) {  // (its ranks came first: a daemon named no layout)
      it->second.layout = std::move(first.layout);
      it->second.digest = digest;
    } else if (!inserted && it->second.digest != digest) {
      it->second.fail(strCat("group ", quote(group), " is registered with two layouts (", it->second.digest, " and ",
                             digest, " on node ", quote(node), ")"));
    }
  };
  std::set<std::string> nodes;
  for (const auto& d : v.daemons_) {
    if (!nodes.insert(d.node()).second)
      return absl::FailedPreconditionError(strCat("two daemons claim node \"", d.node(), "\" (instances ", d.instance(),
                                                  " and another): give every daemon its own --node"));
    // What is wrong with one group fails the syncs that use it, never the view: every other group
    // stays usable (one uid's inconsistent group stopped every sync of the cluster).
    for (const auto& layout : d.layouts()) {  // sent whole: this daemon's own, or an older daemon's
      LayoutKey key{layout.group(), planner::layoutDigest(layout)};
      const auto known = layouts.found.find(key);
      addLayout(key.first, key.second, d.node(),
                known != layouts.found.end() ? known->second : std::make_shared<const v1::Layout>(layout));
    }
    for (const auto& [group, digest] : d.layout_digests()) {
      const LayoutKey key{group, digest};
      if (const auto known = layouts.found.find(key); known != layouts.found.end()) {
        addLayout(group, digest, d.node(), known->second);
      } else {  // (no daemon naming it sent it)
        const auto why = layouts.missing.find(key);
        v.groups_[group].fail(why != layouts.missing.end()
                                  ? why->second
                                  : strCat("the layout of group ", quote(group), " (digest ", digest, ") on node ",
                                           quote(d.node()), " was not gathered"));
      }
    }
    for (const auto& a : d.access()) v.access_[a.group()].emplace_back(d.node(), a);
    for (const auto& r : d.ranks()) {
      auto& g = v.groups_[r.group()];
      const v1::Role role = r.role() == v1::ROLE_SOURCE ? v1::ROLE_SOURCE : v1::ROLE_DESTINATION;
      if (g.role != v1::ROLE_UNSPECIFIED && g.role != role)
        g.fail(strCat("group ", quote(r.group()), " rank ", r.rank(), " on node ", quote(d.node()),
                      " is registered as ", v1::roleName(role), " but other ranks as ", v1::roleName(g.role)));
      if (g.role == v1::ROLE_UNSPECIFIED) g.role = role;
      if (!g.ranks.insert(r.rank()).second)
        g.fail(strCat("group ", quote(r.group()), " rank ", r.rank(), " is registered twice (again on node ",
                      quote(d.node()), ")"));
    }
  }
  for (const auto& [key, why] : layouts.missing) v.missing_layouts_.push_back(why);
  v.findOwners();
  return v;
}

void ClusterView::findOwners() {
  for (const auto& [group, claims] : access_) {
    // The group's owner: the claim registered first (a time unknown, from an older daemon, after
    // every known one; ties by node name, for one answer on every coordinator).
    const auto earlier = [](const Claim& a, const Claim& b) {
      const uint64_t ta = a.second.since_unix_ms() ? a.second.since_unix_ms() : UINT64_MAX;
      const uint64_t tb = b.second.since_unix_ms() ? b.second.since_unix_ms() : UINT64_MAX;
      return std::tie(ta, a.first) < std::tie(tb, b.first);
    };
    const Claim& first = *std::min_element(claims.begin(), claims.end(), earlier);
    owners_[group] = Owner{first.second.owner_uid(), first.second.since_unix_ms()};
    const auto g = groups_.find(group);
    if (g == groups_.end()) continue;  // reserved only: no sync can use it
    // Every other claim must be the same uid's: a rank another uid registered on another node
    // (where its daemon could not know the group) is named, and no sync reads or writes the group.
    for (const Claim& other : claims) {
      if (other.second.owner_uid() == first.second.owner_uid()) continue;
      const std::string owner =
          strCat("the group is uid ", first.second.owner_uid(), "'s (registered first, on node ", quote(first.first),
                 first.second.reserved() ? ", which holds its name since its daemon restarted" : "",
                 "): every rank of a group, on every node, is its owner's");
      if (other.second.reserved()) {
        g->second.conflict = strCat("group ", quote(group), ": node ", quote(other.first), " holds its name for uid ",
                                    other.second.owner_uid(), " since its daemon restarted, but ", owner);
        break;
      }
      std::vector<int32_t> ranks;
      for (const auto& d : daemons_)
        if (d.node() == other.first)
          for (const auto& r : d.ranks())
            if (r.group() == group) ranks.push_back(r.rank());
      std::sort(ranks.begin(), ranks.end());
      g->second.conflict =
          strCat("group ", quote(group), ": ", ranks.size() == 1 ? "rank " : "ranks ", rankRanges(ranks), " on node ",
                 quote(other.first), " ", ranks.size() == 1 ? "is" : "are", " registered by uid ",
                 other.second.owner_uid(), ", but ", owner);
      break;
    }
  }
}

std::string ClusterView::problem(const std::string& group) const {
  const auto it = groups_.find(group);
  if (it == groups_.end()) return "";
  return it->second.conflict.empty() ? it->second.problem : it->second.conflict;
}

uint64_t ClusterView::registeredSince(const std::string& group) const {
  const auto it = owners_.find(group);
  return it == owners_.end() ? 0 : it->second.since_unix_ms;
}

Status ClusterView::maySync(uint32_t uid, const std::string& src, const std::string& dst) const {
  auto owners = [&](const std::string& group) {
    auto it = access_.find(group);
    return it == access_.end() ? std::vector<std::pair<std::string, v1::GroupAccess>>{} : it->second;
  };
  // (A name reserved after a restart holds no part of the group: its owner's claim is checked
  // where the view is built.)
  for (const auto& [node, a] : owners(dst))
    if (!a.reserved() && a.owner_uid() != uid)
      return absl::PermissionDeniedError(strCat("sync: uid ", uid, " may not write group ", quote(dst), ": it is uid ",
                                                a.owner_uid(), "'s on node ", quote(node),
                                                " (only a destination's owner syncs into it)"));
  for (const auto& [node, a] : owners(src)) {
    const bool granted = std::find(a.readers().begin(), a.readers().end(), uid) != a.readers().end();
    if (!a.reserved() && a.owner_uid() != uid && !granted)
      return absl::PermissionDeniedError(strCat("sync: uid ", uid, " may not read group ", quote(src), ": it is uid ",
                                                a.owner_uid(), "'s on node ", quote(node),
                                                ", who has not granted it (RegisterRequest.readers)"));
  }
  return absl::OkStatus();
}

std::optional<uint32_t> ClusterView::ownerOf(const std::string& group) const {
  const auto it = owners_.find(group);
  if (it == owners_.end()) return std::nullopt;
  return it->second.uid;
}

Status ClusterView::mayReceive(const std::string& src, const std::string& group) const {
  const auto owner = ownerOf(group);
  if (!owner) return absl::OkStatus();  // described by no daemon: completeGroup refuses it
  if (Status allowed = maySync(*owner, src, group); !allowed.ok())
    return absl::PermissionDeniedError(strCat("group ", quote(group), " is uid ", *owner,
                                              "'s, who may not receive group ", quote(src), "'s bytes (",
                                              allowed.message(), ")"));
  return absl::OkStatus();
}

bool ClusterView::namedAsSet(const std::string& set) const {
  return !set.empty() && std::any_of(groups_.begin(), groups_.end(),
                                     [&](const auto& g) { return g.second.get().replica_set() == set; });
}

v1::Role ClusterView::role(const std::string& group) const {
  auto it = groups_.find(group);
  return it == groups_.end() ? v1::ROLE_UNSPECIFIED : it->second.role;
}

void ClusterView::keepDaemons(const std::vector<bool>& keep) {
  std::vector<v1::DescribeResponse> kept;
  for (size_t i = 0; i < daemons_.size(); ++i)
    if (keep[i]) kept.push_back(std::move(daemons_[i]));
  daemons_ = std::move(kept);
}

std::vector<std::string> ClusterView::replicasOf(const std::string& set, bool despite_group) const {
  std::vector<std::pair<int32_t, std::string>> found;
  if (set.empty() || (groups_.count(set) && !despite_group)) return {};
  for (const auto& [name, g] : groups_)
    if (g.get().replica_set() == set) found.emplace_back(g.get().replica(), name);
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [id, name] : found) out.push_back(std::move(name));
  return out;
}

const v1::Layout* ClusterView::layoutOf(const std::string& group) const {
  const auto it = groups_.find(group);
  return it == groups_.end() ? nullptr : &it->second.get();
}

StatusOr<v1::Layout> ClusterView::completeGroup(const std::string& group) const {
  auto it = groups_.find(group);
  if (const std::string why = problem(group); !why.empty()) return absl::FailedPreconditionError(why);
  if (it == groups_.end()) {
    std::vector<std::string> known;
    for (const auto& [name, g] : groups_) known.push_back("\"" + name + "\"");
    return absl::FailedPreconditionError(strCat("group \"", group, "\" has no registered ranks (registered groups: ",
                                                known.empty() ? "none" : strJoin(known, ", "), ")"));
  }
  int64_t world = 1;
  for (int64_t s : it->second.get().mesh().shape()) world *= s;
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < world; ++r)
    if (!it->second.ranks.count(r)) missing.push_back(r);
  if (!missing.empty())
    return absl::FailedPreconditionError(strCat("group \"", group, "\" is incomplete: ranks ", rankRanges(missing),
                                                " of ", world, " are not registered"));
  return it->second.get();
}

}  // namespace shardcast::daemon

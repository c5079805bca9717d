// The UCX backend's settings (ucx_options.h): parsed from TransportOptions::settings, and what a
// UCX_TLS list implies for the protocol, RMA safety, peer-failure handling and TCP.
#include "transport/ucx/ucx_options.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "common/strings.h"

namespace shardcast::transport {

namespace {

// A UCX_TLS value: its transport names, and whether it lists the ones to leave out ("^a,b").
struct TlsList {
  std::vector<std::string> items;
  bool exclude = false;
  bool empty() const { return items.empty(); }  // UCX's default: every transport
  bool names(const std::string& t) const { return std::find(items.begin(), items.end(), t) != items.end(); }
};

TlsList parseTls(const std::string& tls) {
  TlsList l;
  l.exclude = !tls.empty() && tls[0] == '^';
  std::stringstream ss(l.exclude ? tls.substr(1) : tls);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) l.items.push_back(item);
  return l;
}

// A byte count in decimal digits, nothing else.
StatusOr<size_t> parseBytes(const std::string& name, const std::string& value) {
  const bool digits =
      !value.empty() && value.size() <= 19 && value.find_first_not_of("0123456789") == std::string::npos;
  if (!digits)
    return absl::InvalidArgumentError(
        strCat("transport setting ", name, "=", quote(value), ": expected a byte count (decimal digits)"));
  return static_cast<size_t>(std::stoull(value));
}

}  // namespace

std::string_view protocolName(Protocol protocol) {
  switch (protocol) {
    case Protocol::kPut:
      return "put";
    case Protocol::kAm:
      return "am";
    default:
      return "auto";
  }
}

StatusOr<Protocol> parseProtocol(std::string_view name) {
  for (const Protocol p : {Protocol::kAuto, Protocol::kPut, Protocol::kAm})
    if (name == protocolName(p)) return p;
  return absl::InvalidArgumentError(strCat("transport protocol \"", name, "\" (expected auto, put or am)"));
}

StatusOr<UcxOptions> UcxOptions::fromSettings(const TransportOptions& options) {
  UcxOptions u;
  for (const auto& [name, value] : settingsOf(options, "ucx")) {
    const std::string full = "ucx." + name;
    if (name == "tls") {
      u.tls = value;
    } else if (name == "protocol") {
      auto p = parseProtocol(value);
      if (!p.ok()) return absl::InvalidArgumentError(strCat("transport setting ", full, ": ", p.status().message()));
      u.protocol = *p;
    } else if (name == "tcp_segment_bytes") {
      SC_ASSIGN_OR_RETURN(u.tcp_segment_bytes, parseBytes(full, value));
    } else {
      return absl::InvalidArgumentError(strCat("unknown transport setting ", quote(full),
                                               " (expected ucx.tls, ucx.protocol or ucx.tcp_segment_bytes)"));
    }
  }
  return u;
}

StatusOr<ResolvedUcxOptions> resolveUcxOptions(const TransportOptions& options) {
  ResolvedUcxOptions r;
  SC_ASSIGN_OR_RETURN(r.options, UcxOptions::fromSettings(options));
  r.tls = r.options.tls;
  if (r.tls.empty()) {
    const char* env = std::getenv("UCX_TLS");
    if (env) r.tls = env;
  }
  r.protocol = r.options.protocol == Protocol::kAuto ? autoProtocolFor(r.tls) : r.options.protocol;
  if (options.bounded_writes_only && r.protocol == Protocol::kPut && !putIsBounded(r.tls)) {
    if (r.options.protocol == Protocol::kPut)
      return absl::InvalidArgumentError(
          strCat("ucx.protocol put over UCX_TLS=", r.tls.empty() ? "(UCX's default)" : r.tls,
                 ": these transports cannot bound a peer's writes to the registered region (tcp, cma and shared "
                 "memory emulate RMA): use protocol auto (active messages there) or am, name only rc/dc/cuda "
                 "transports, or accept unbounded writes (shardcastd --insecure)"));
    r.protocol = Protocol::kAm;
  }
  return r;
}

Status checkUcxOptions(const TransportOptions& options) { return resolveUcxOptions(options).status(); }

bool hasNetworkTransport(const std::string& tls) {
  const TlsList l = parseTls(tls);
  if (l.empty() || l.exclude) return true;
  for (const auto& item : l.items)
    if (item != "self" && item != "posix" && item != "sysv" && item != "cma" && item != "sm" && item != "shm" &&
        item != "mm" && item != "knem" && item != "xpmem")
      return true;
  return false;
}

bool mayUseTcp(const std::string& tls) {
  const TlsList l = parseTls(tls);
  const bool named = l.names("tcp") || l.names("all");
  return l.empty() || (l.exclude ? !named : named);
}

bool putIsBounded(const std::string& tls) {
  const TlsList l = parseTls(tls);
  if (l.empty() || l.exclude) return false;  // UCX's default set includes tcp and cma
  for (const auto& item : l.items) {
    // Reliable-connected and dynamically-connected verbs do RDMA in the NIC, bounded by the remote
    // key; UD has no RDMA (UCX emulates put over it), and "ib" would let UCX pick UD.
    const bool hardware = item.rfind("rc", 0) == 0 || item.rfind("dc", 0) == 0 || item.rfind("cuda", 0) == 0 ||
                          item == "gdr_copy" || item == "self";
    if (!hardware) return false;
  }
  return true;
}

Protocol autoProtocolFor(const std::string& tls) {
  const TlsList l = parseTls(tls);
  if (l.empty() || l.exclude || !l.names("tcp")) return Protocol::kPut;
  for (const auto& item : l.items)
    if (item != "tcp" && item != "self") return Protocol::kPut;
  return Protocol::kAm;
}

}  // namespace shardcast::transport

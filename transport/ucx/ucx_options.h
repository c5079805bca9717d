// The UCX backend's settings: how they are named in TransportOptions::settings ("ucx.tls",
// "ucx.protocol", "ucx.tcp_segment_bytes"), parsed and checked, and what a UCX_TLS list implies.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "common/status.h"
#include "transport/transport.h"

namespace shardcast::transport {

// How UCX writes travel: RMA put + flush, or active messages into registered memory, acked (the
// target's handler checks every range and the sync's fence); auto picks per transport
// (TransportOptions::bounded_writes_only, docs/transport.md).
enum class Protocol { kAuto, kPut, kAm };
std::string_view protocolName(Protocol protocol);
// "auto", "put" or "am"; INVALID_ARGUMENT naming the others.
StatusOr<Protocol> parseProtocol(std::string_view name);

struct UcxOptions {
  // ucx.tls: transports to use (UCX_TLS syntax, e.g. "tcp", "posix,sysv,self"); empty = UCX_TLS
  // from the environment, else UCX's default.
  std::string tls;
  // ucx.protocol: auto is am when the transports are TCP only (UCX 1.13's TCP put is ~4x slower),
  // else put. With TransportOptions::bounded_writes_only, put only over transports whose hardware
  // checks the remote key (InfiniBand/RoCE rc/dc, CUDA IPC), never over tcp, cma or shared memory,
  // where UCX's emulated RMA writes wherever an address and key point: auto then picks am there
  // and an explicit put is INVALID_ARGUMENT.
  Protocol protocol = Protocol::kAuto;
  // ucx.tcp_segment_bytes: over TCP, the segment size (UCX_TCP_RX_SEG_SIZE), which bounds each
  // fragment a large write travels in, one sendmsg(2) per fragment. UCX's default of 64 KiB makes
  // 16x the system calls of 1 MiB, and each one traps under virtualisation. 0 keeps UCX's own; an
  // explicit UCX_TCP_RX_SEG_SIZE in the environment wins over this.
  size_t tcp_segment_bytes = size_t{1} << 20;

  // The "ucx." settings of `options` over the defaults; INVALID_ARGUMENT naming a setting that is
  // unknown or has a bad value.
  static StatusOr<UcxOptions> fromSettings(const TransportOptions& options);
};

// What a UCX context is made with: its settings, the transports in effect and the protocol they
// resolve to.
struct ResolvedUcxOptions {
  UcxOptions options;
  std::string tls;                     // options.tls, else UCX_TLS from the environment ("" = UCX's default)
  Protocol protocol = Protocol::kPut;  // put or am
};
// Parses the settings and resolves the protocol; INVALID_ARGUMENT for a bad setting, or for an
// explicit put over transports that cannot bound it when options.bounded_writes_only.
StatusOr<ResolvedUcxOptions> resolveUcxOptions(const TransportOptions& options);
// resolveUcxOptions' verdict alone (the backend table's check).
Status checkUcxOptions(const TransportOptions& options);

// am or put: what protocol auto resolves to for a UCX_TLS value ("" = UCX's default), before
// TransportOptions::bounded_writes_only.
Protocol autoProtocolFor(const std::string& tls);
// Whether every transport of a UCX_TLS list bounds a remote write to the registered region in
// hardware (rc/dc verbs, CUDA IPC; ud carries no RMA): put is safe against a peer that lies.
bool putIsBounded(const std::string& tls);
// True when the UCX_TLS list can reach another host (then peer-failure handling is available);
// UCX 1.13's shared-memory transports have none and refuse PEER error handling.
bool hasNetworkTransport(const std::string& tls);
// True when the UCX_TLS list lets UCX use TCP (an exclusion list unless it names tcp).
bool mayUseTcp(const std::string& tls);

}  // namespace shardcast::transport

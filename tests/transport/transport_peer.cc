// A transport endpoint in its own process, for cross-process tests (peer killed mid-transfer,
// network namespaces). Protocol on stdin/stdout, one line each:
//   transport_peer recv --tls T [--protocol P] --size N
//       prints "ADDRESS <hex>", "REGION <hex>" and "KEY <hex>" (a write key open over the whole
//       region); for each notification "check SEED LEN" prints
//       "OK SEED" or "BAD SEED OFFSET"; exits 0 at EOF on stdin.
//   transport_peer send --tls T [--protocol P] --size N --seed S --address HEX --region HEX --key HEX
//       writes N pattern bytes (64 MiB writes, pipelined), notifies "check S N", prints "SENT"
//       (exit 0) or "ERROR <message>" (exit 1).
#include <cstdio>
#include <future>
#include <iostream>
#include <string>
#include <vector>

#include "tests/transport/process.h"
#include "transport/transport.h"

using namespace shardcast;
using namespace shardcast::transport;
using namespace shardcast::testing;

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback = "") {
  for (int i = 2; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

int fail(const Status& st) {
  std::printf("ERROR %s\n", std::string(st.message()).c_str());
  std::fflush(stdout);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: transport_peer recv|send --tls T --size N ...\n");
    return 2;
  }
  const std::string role = argv[1];
  TransportOptions opts;
  opts.name = role == "recv" ? "peer-recv" : "peer-send";
  opts.settings = {{"ucx.tls", arg(argc, argv, "--tls")}, {"ucx.protocol", arg(argc, argv, "--protocol", "auto")}};
  if (const Status checked = checkOptions(opts); !checked.ok()) {
    std::fprintf(stderr, "%s\n", std::string(checked.message()).c_str());
    return 2;
  }
  const size_t size = std::stoull(arg(argc, argv, "--size", "1048576"));
  auto ctx = createContext(opts);
  if (!ctx.ok()) return fail(ctx.status());
  std::vector<unsigned char> buf(size);

  if (role == "recv") {
    auto region = (*ctx)->registerMemory(buf.data(), buf.size(), MemoryKind::kHost);
    if (!region.ok()) return fail(region.status());
    const WriteKey key = WriteKey::random();
    if (!(*ctx)->openFence(key, {{(*region)->remote().base, (*region)->size()}})) return 1;
    (*ctx)->setNotificationHandler([&](std::string msg, const WriteKey&) {
      uint64_t seed = 0, len = 0;
      if (std::sscanf(msg.c_str(), "check %lu %lu", &seed, &len) == 2) {
        const size_t bad = checkPattern(buf.data(), std::min<size_t>(len, buf.size()), seed);
        if (bad == len)
          std::printf("OK %lu\n", seed);
        else
          std::printf("BAD %lu %zu\n", seed, bad);
        std::fflush(stdout);
      }
    });
    std::printf("ADDRESS %s\nREGION %s\nKEY %s\n", toHex((*ctx)->address()).c_str(),
                toHex((*region)->remote().serialize()).c_str(), toHex(std::string(key.view())).c_str());
    std::fflush(stdout);
    std::string line;
    while (std::getline(std::cin, line)) {
    }
    return 0;
  }

  const uint64_t seed = std::stoull(arg(argc, argv, "--seed", "1"));
  fillPattern(buf.data(), buf.size(), seed);
  auto region = (*ctx)->registerMemory(buf.data(), buf.size(), MemoryKind::kHost);
  if (!region.ok()) return fail(region.status());
  auto remote = RemoteRegion::parse(fromHex(arg(argc, argv, "--region")));
  if (!remote.ok()) return fail(remote.status());
  auto key = WriteKey::fromBytes(fromHex(arg(argc, argv, "--key")));
  if (!key.ok()) return fail(key.status());
  auto ep = (*ctx)->connect(fromHex(arg(argc, argv, "--address")), "peer-recv");
  if (!ep.ok()) return fail(ep.status());
  const size_t chunk = size_t{64} << 20;
  std::vector<std::future<Status>> pending;
  for (size_t off = 0; off < size; off += chunk) {
    auto p = std::make_shared<std::promise<Status>>();
    pending.push_back(p->get_future());
    (*ep)->write({*region, off, *remote, off, std::min(chunk, size - off), *key}, [p](Status st) { p->set_value(st); });
  }
  auto p = std::make_shared<std::promise<Status>>();
  pending.push_back(p->get_future());
  (*ep)->notify("check " + std::to_string(seed) + " " + std::to_string(size), *key,
                [p](Status st) { p->set_value(st); });
  for (auto& f : pending) {
    const Status st = f.get();
    if (!st.ok()) return fail(st);
  }
  std::printf("SENT\n");
  std::fflush(stdout);
  return 0;
}

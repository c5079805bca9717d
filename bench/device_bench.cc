// GPU figures (prints them; scripts/device-check.sh runs it where a GPU is, docs/gpu.md keeps them):
//   copy   the CUDA copy engine packing a strided box (a TP column slice of a row-major bf16
//          matrix) into a dense buffer and unpacking it back, one kernel launch each, beside a
//          device-to-device copy of the same bytes (cudaMemcpyAsync), and host<->device staging
//          through pinned memory; the fp8 kernel quantising bf16 (values, then scales) beside it
//   sync   real daemons syncing device tensors on both sides (CUDA IPC registrations): trainer
//          ranks FSDP row shards on node n0 -> inference ranks TP column shards on n1 (with
//          --daemons 3, a second replica on n2: a relay chain n0 -> n1 -> n2; with --daemons 1,
//          two replicas beside the trainer on n0: colocated copies), GB/s per sync,
//          every byte checked after the last; the daemons' transport is printed (staged or
//          straight into device memory: scripts/device-check.sh runs it with each UCX); with
//          --delta, each version changes 1% of the rows and the syncs alternate dense and delta
//          (encoded and rebuilt on the GPUs with --daemon-flag --delta-device-mib ...)
//   delta  the delta kernels: encode, apply and tree-hash GB/s of 64 MiB chunks beside the D2D copy
// Without a GPU it says why and exits 0.
// Usage: device_bench [--mib N] [--syncs N] [--daemons 1|2|3] [--sync-only] [--delta] [--daemon-flag F]...
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "planner/layout.h"
#include "tests/support/device_buffer.h"
#include "tests/support/local_daemon.h"
#include "transport/copy_engine.h"
#include "transport/cuda/cuda_support.h"
#include "transport/cuda/fp8_quantize.h"

using namespace shardcast;
using Clock = std::chrono::steady_clock;

namespace {

double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

[[noreturn]] void fail(const std::string& what) {
  fmt::print(stderr, "device_bench: {}\n", what);
  std::exit(1);
}

template <typename T>
T must(StatusOr<T> v, const char* what) {
  if (!v.ok()) fail(fmt::format("{}: {}", what, std::string(v.status().message())));
  return std::move(*v);
}

void must(const Status& st, const char* what) {
  if (!st.ok()) fail(fmt::format("{}: {}", what, std::string(st.message())));
}

// Best of `iters` timed runs of `fn` (each synchronised), after one warm-up.
template <typename Fn>
double bestSeconds(int iters, transport::CopyEngine& engine, Fn&& fn) {
  fn();
  must(engine.synchronize(), "warm-up");
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    must(engine.synchronize(), "timed copy");
    best = std::min(best, seconds(t0, Clock::now()));
  }
  return best;
}

// Deltas on the GPU (transport/cuda/delta_kernels.h), chunk by chunk as a sync runs them: two
// versions of `bytes` of bf16 at `a` with 1% of the elements apart, each encoded against the other
// (the base, which becomes it), applied to the other, and tree-hashed. GB/s of the dense chunk;
// issue 51 asks for a delta sync of device memory at most half a dense one.
void deltaFigures(transport::CopyEngine& engine, std::byte* a, size_t bytes, double d2d_gbps) {
  const size_t chunk = std::min<size_t>(bytes, size_t{64} << 20), unit = 2;
  const size_t chunks = bytes / chunk, span = chunks * chunk;
  std::vector<std::byte> host(span);
  must(testing::copyFromDevice(host.data(), a, span), "read back");
  auto other = must(testing::allocateDevice(span, 0), "device buffer");
  auto base = must(testing::allocateDevice(span, 0), "device buffer");
  auto* b = static_cast<std::byte*>(other->data());
  for (size_t u = 0; u < span / unit; u += 100) host[u * unit] ^= std::byte{1};  // 1% of the elements
  must(testing::copyToDevice(b, host.data(), span), "fill");
  must(testing::copyToDevice(base->data(), host.data(), span), "fill");
  auto* into = static_cast<std::byte*>(base->data());
  std::vector<std::byte> out(chunk);
  std::vector<std::vector<std::byte>> deltas[2];  // per chunk: a against b, b against a
  size_t delta_bytes = 0;
  int turn = 0;
  auto encodeAll = [&](bool keep) {
    const std::byte* now = turn % 2 == 0 ? a : b;  // the base holds the other version
    for (size_t c = 0; c < chunks; ++c) {
      uint64_t hash = 0;
      const auto size =
          must(engine.encodeDelta(now + c * chunk, into + c * chunk, chunk, unit, out.data(), chunk * 3 / 4, &hash),
               "delta encode");
      if (!size) fail("delta encode: 1% of the elements did not fit in 3/4 of the chunk");
      if (keep) deltas[turn % 2].emplace_back(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(*size));
      delta_bytes = *size;
    }
    ++turn;
  };
  encodeAll(true);  // a against b, and b against a: the deltas applied below
  encodeAll(true);
  const int iters = 6;
  const double encode = bestSeconds(iters, engine, [&] { encodeAll(false); });
  // The base holds a or b after an even or odd number of encodes: apply what turns it into the other.
  const double apply = bestSeconds(iters, engine, [&] {
    const auto& d = deltas[turn % 2];
    for (size_t c = 0; c < chunks; ++c)
      must(engine.applyDelta(into + c * chunk, chunk, unit, d[c].data(), d[c].size()), "delta apply");
    ++turn;
  });
  const double hash = bestSeconds(iters, engine, [&] {
    for (size_t c = 0; c < chunks; ++c) must(engine.treeHashOf(a + c * chunk, chunk), "tree hash");
  });
  const double gb = static_cast<double>(span) / 1e9;
  fmt::print("== deltas on the GPU: {} chunk(s) of {} MiB bf16, 1% of the elements changed ({} B delta per chunk)\n",
             chunks, chunk >> 20, delta_bytes);
  fmt::print("RESULT delta encode_gbps {:.1f} apply_gbps {:.1f} hash_gbps {:.1f} d2d_gbps {:.1f}\n", gb / encode,
             gb / apply, gb / hash, d2d_gbps);
  fmt::print(
      "   (GB/s of the dense chunks; encode: summaries, leaf hashes, placement on the host, records, the\n"
      "    delta copied out; apply: parsed on the host, scattered and hashed on the GPU; best of {})\n",
      iters);
}

void copyFigures(int64_t mib) {
  auto engine = must(transport::makeCudaCopyEngine(0), "CUDA copy engine");
  // bf16 [rows, 8192]; a TP=4 column slice is rows x 2048 (4 KiB runs).
  const int64_t cols = 8192, slice = 2048, elem = 2;
  const int64_t rows = std::max<int64_t>(1, (mib << 20) / (slice * elem));
  const size_t slice_bytes = static_cast<size_t>(rows * slice * elem);
  auto full = must(testing::allocateDevice(static_cast<size_t>(rows * cols * elem), 0), "device buffer");
  auto dense = must(testing::allocateDevice(slice_bytes, 0), "device buffer");
  auto other = must(testing::allocateDevice(slice_bytes, 0), "device buffer");
  std::vector<std::byte> host(slice_bytes);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<std::byte>(i * 131 + 7);
  must(testing::copyToDevice(full->data(), host.data(), host.size()), "fill");
  auto* base = static_cast<std::byte*>(full->data());
  const transport::StridedView strided{base, transport::MemoryKind::kCuda, slice, {cols, 1}};
  const transport::StridedView packed{
      static_cast<std::byte*>(dense->data()), transport::MemoryKind::kCuda, 0, {slice, 1}};
  const transport::StridedView copy_to{
      static_cast<std::byte*>(other->data()), transport::MemoryKind::kCuda, 0, {slice, 1}};
  const int iters = 10;
  const double pack = bestSeconds(iters, *engine, [&] {
    must(engine->copy(packed, strided, {rows, slice}, elem), "pack");
  });
  const double unpack = bestSeconds(iters, *engine, [&] {
    must(engine->copy(strided, packed, {rows, slice}, elem), "unpack");
  });
  const double d2d = bestSeconds(iters, *engine, [&] {
    must(engine->copy(copy_to, packed, {rows, slice}, elem), "d2d");
  });
  // Pinned staging (what a transport without CUDA support goes through).
  auto pinned = must(transport::allocatePinned(slice_bytes), "pinned buffer");
  const transport::StridedView pin{static_cast<std::byte*>(pinned->data()), transport::MemoryKind::kHost, 0, {1}};
  const transport::StridedView dev{static_cast<std::byte*>(dense->data()), transport::MemoryKind::kCuda, 0, {1}};
  const int64_t n = static_cast<int64_t>(slice_bytes);
  const double d2h = bestSeconds(iters, *engine, [&] { must(engine->copy(pin, dev, {n}, 1), "d2h"); });
  const double h2d = bestSeconds(iters, *engine, [&] { must(engine->copy(dev, pin, {n}, 1), "h2d"); });
  const double gb = static_cast<double>(slice_bytes) / 1e9;
  fmt::print("== copy engine, {:.0f} MiB bf16 (a {} x {} column slice of {} columns, {} B runs)\n",
             static_cast<double>(slice_bytes) / (1 << 20), rows, slice, cols, slice * elem);
  fmt::print(
      "RESULT copy pack_gbps {:.1f} unpack_gbps {:.1f} d2d_gbps {:.1f} pack_of_d2d {:.0f}% d2h_gbps {:.1f} "
      "h2d_gbps {:.1f}\n",
      gb / pack, gb / unpack, gb / d2d, 100 * d2d / pack, gb / d2h, gb / h2d);
  fmt::print("   (GB/s of bytes moved, reads and writes counted once; best of {})\n", iters);

  // fp8: the dense slice (rows x 2048 bf16) quantised in 128 x 128 blocks by the kernel, beside
  // the copy of the same bytes: issue 51's target is 2 GiB of bf16 in at most 3 ms on an H200.
  transport::Fp8QuantizeBox box;
  box.shape = {rows, slice};
  box.block = {128, 128};
  box.lo = {0, 0};
  box.hi = {rows, slice};
  box.src_strides = {slice, 1};
  box.dst_strides = {slice, 1};
  box.bf16 = true;
  auto fp8 = must(testing::allocateDevice(static_cast<size_t>(rows * slice), 0), "device buffer");
  const transport::StridedView q{static_cast<std::byte*>(fp8->data()), transport::MemoryKind::kCuda, 0, {slice, 1}};
  const double quantise = bestSeconds(iters, *engine, [&] { must(engine->quantizeFp8(q, packed, box), "fp8"); });
  box.scales = true;
  box.hi = {(rows + 127) / 128, slice / 128};
  auto scales = must(testing::allocateDevice(static_cast<size_t>(box.hi[0] * box.hi[1] * 4), 0), "device buffer");
  const transport::StridedView sv{
      static_cast<std::byte*>(scales->data()), transport::MemoryKind::kCuda, 0, {box.hi[1], 1}};
  const double scaling = bestSeconds(iters, *engine, [&] { must(engine->quantizeFp8(sv, packed, box), "scales"); });
  fmt::print("RESULT fp8 quantise_gbps {:.1f} scales_gbps {:.1f} d2d_gbps {:.1f} ms_per_2gib {:.2f}\n", gb / quantise,
             gb / scaling, gb / d2d, quantise / gb * 2.147 * 1e3);
  fmt::print("   (GB/s of bf16 input; the fp8 values and the scales are two launches, as a sync runs them)\n");
  deltaFigures(*engine, static_cast<std::byte*>(dense->data()), slice_bytes, gb / d2d);
}

struct DeviceRank {
  std::vector<std::unique_ptr<testing::DeviceBuffer>> buffers;  // by buffer id
};

struct SyncBench {
  // 3: a second replica on n2, relayed through n1; 1: two replicas on n0 beside the trainer
  // (colocated: device-to-device copies, no network).
  int daemons = 2;
  std::vector<std::string> daemon_flags;  // given to every daemon (e.g. --ucx-tls)
  // Each version changes 1% of the rows (row % 100 == version % 100), synced alternately dense
  // (DELTA_DENSE, bases kept) and as deltas (DELTA_ALWAYS): issue 51's delta sync against dense.
  bool delta = false;
};

// The last version up to `version` that changed `row` (versions from 2 change rows
// row % 100 == version % 100; 1: none did).
int lastChange(int64_t row, int version) {
  for (int v = version; v >= 2; --v)
    if (static_cast<int64_t>(v % 100) == row % 100) return v;
  return 1;
}

void syncFigures(int64_t mib, int syncs, const SyncBench& bench) {
  // float32 [rows, 4096]: FSDP row shards over 2 trainer ranks -> TP column shards over 2.
  const int64_t cols = 4096;
  const int64_t rows = std::max<int64_t>(2, (mib << 20) / (cols * 4)) / 2 * 2;
  const std::string shape = fmt::format("[{},{}]", rows, cols);
  const auto src_proto =
      must(planner::parseLayoutJson(R"({"group":"dev-trainer","mesh":{"shape":[2]},"nodes":["n0","n0"],
    "tensors":[{"name":"w","shape":)" + shape +
                                        R"(,"dtype":"float32","placements":[{"shard":{"dim":0}}]}]})",
                                    "trainer"),
           "layout");
  const bool relay = bench.daemons == 3, colocated = bench.daemons == 1;
  const auto dst_proto = must(
      planner::parseLayoutJson(
          relay || colocated
              ? R"({"group":"dev-infer","mesh":{"shape":[2,2]},"nodes":)" +
                    std::string(colocated ? R"(["n0","n0","n0","n0"])" : R"(["n1","n1","n2","n2"])") +
                    R"(,"tensors":[{"name":"w","shape":)" + shape +
                    R"(,"dtype":"float32","placements":[{"replicate":{}},{"shard":{"dim":1}}]}]})"
              : R"({"group":"dev-infer","mesh":{"shape":[2]},"nodes":["n1","n1"],"tensors":[{"name":"w","shape":)" +
                    shape + R"(,"dtype":"float32","placements":[{"shard":{"dim":1}}]}]})",
          "infer"),
      "layout");
  planner::NodeTable nodes;
  const auto src = must(planner::resolveLayout(src_proto, nodes), "resolve");
  const auto dst = must(planner::resolveLayout(dst_proto, nodes), "resolve");
  std::vector<int> ports;
  std::vector<std::string> peers;
  for (int i = 0; i < bench.daemons; ++i) {
    ports.push_back(examples::freePort());
    peers.push_back("127.0.0.1:" + std::to_string(ports.back()));
  }
  std::vector<std::unique_ptr<examples::Daemon>> daemons;
  for (int i = 0; i < bench.daemons; ++i) {
    daemons.push_back(std::make_unique<examples::Daemon>("n" + std::to_string(i), ports[i], peers, bench.daemon_flags));
    if (!daemons.back()->ready())
      fail("daemon n" + std::to_string(i) + " did not start: " + daemons.back()->readyLine());
  }
  examples::Daemon &n0 = *daemons[0], &n1 = colocated ? n0 : *daemons[1];
  {
    grpc::ClientContext c;
    v1::StatusResponse status;
    if (auto st = n1.client()->Status(&c, v1::StatusRequest(), &status); !st.ok())
      fail("status: " + st.error_message());
    fmt::print("== daemons: {}\n", status.transport());
  }
  auto value = [](int64_t flat, int version) { return static_cast<float>((flat * 7 + version) % 100003); };
  std::vector<DeviceRank> s(2), d(static_cast<size_t>(dst.world()));
  auto make = [&](const planner::ResolvedLayout& l, const v1::Layout& proto, int32_t r, examples::Daemon& node,
                  DeviceRank& m, int version) {
    v1::RegisterRequest req;
    req.set_group(proto.group());
    req.set_rank(r);
    req.set_world_size(l.world());
    if (version > 0) {
      req.set_role(v1::ROLE_SOURCE);
      req.set_version(static_cast<uint64_t>(version));
    }
    *req.mutable_layout() = proto;
    m.buffers.resize(l.buffer_names.size());
    for (const auto& [b, bytes] : l.rankBuffers(r)) {
      auto dev = must(testing::allocateDevice(static_cast<size_t>(bytes), 0), "device buffer");
      std::vector<float> host(static_cast<size_t>(bytes) / 4, 0.f);
      if (version > 0)
        planner::forEachElement(l, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
          if (p.buffer == b) host[static_cast<size_t>(off)] = value(flat, version);
        });
      must(testing::copyToDevice(dev->data(), host.data(), static_cast<size_t>(bytes)), "fill");
      auto* h = req.add_buffers();
      h->set_buffer(l.buffer_names[b]);
      h->mutable_cuda()->set_handle(must(dev->ipcHandle(), "IPC handle"));
      h->mutable_cuda()->set_size(static_cast<uint64_t>(bytes));
      m.buffers[b] = std::move(dev);
    }
    grpc::ClientContext c;
    v1::RegisterResponse resp;
    const auto st = node.client()->Register(&c, req, &resp);
    if (!st.ok()) fail("register: " + st.error_message());
  };
  for (int32_t r = 0; r < 2; ++r) make(src, src_proto, r, n0, s[r], 1);
  for (int32_t r = 0; r < dst.world(); ++r) make(dst, dst_proto, r, r < 2 || colocated ? n1 : *daemons[2], d[r], 0);
  const double gb = static_cast<double>(rows * cols * 4) / 1e9 * (relay || colocated ? 2 : 1);  // delivered
  fmt::print("== sync, {:.0f} MiB float32 device tensors: FSDP rows (2 ranks, n0) -> {}\n",
             static_cast<double>(rows * cols * 4) / (1 << 20),
             colocated ? "2 replicas of TP columns (2 ranks each) on n0 too, colocated: GB/s of both replicas' bytes"
             : relay   ? "TP columns (2 ranks, n1) and a second replica (2 ranks, n2) relayed through n1: GB/s of both "
                         "replicas' bytes"
                       : "TP columns (2 ranks, n1)");
  std::vector<double> figures;
  double best_dense = 0, best_delta = 0;
  uint64_t gpu_encoded = 0, gpu_rebuilt = 0;
  // With --delta: the rows version v changes, written into the source ranks' device memory.
  auto change = [&](int v) {
    const int64_t half = rows / 2;
    std::vector<float> row(static_cast<size_t>(cols));
    for (int64_t g = v % 100; g < rows; g += 100) {
      const int32_t r = static_cast<int32_t>(g / half);
      for (int64_t c = 0; c < cols; ++c) row[static_cast<size_t>(c)] = value(g * cols + c, v);
      for (auto& b : s[r].buffers)
        if (b)
          must(testing::copyToDevice(static_cast<std::byte*>(b->data()) + (g - r * half) * cols * 4, row.data(),
                                     row.size() * 4),
               "change a row");
    }
  };
  for (int v = 1; v <= syncs; ++v) {
    if (bench.delta && v > 1) change(v);
    if (v > 1) {  // the trainer publishes v (without --delta, the same bytes: the figure is the sync's)
      for (int32_t r = 0; r < 2; ++r) {
        for (const char* what : {"acquire", "release"}) {
          grpc::ClientContext c;
          if (std::string(what) == "acquire") {
            v1::AcquireRequest a;
            a.set_group("dev-trainer");
            a.set_rank(r);
            v1::AcquireResponse ar;
            if (auto st = n0.client()->Acquire(&c, a, &ar); !st.ok()) fail("acquire: " + st.error_message());
          } else {
            v1::ReleaseRequest a;
            a.set_group("dev-trainer");
            a.set_rank(r);
            a.set_version(static_cast<uint64_t>(v));
            v1::ReleaseResponse ar;
            if (auto st = n0.client()->Release(&c, a, &ar); !st.ok()) fail("release: " + st.error_message());
          }
        }
      }
    }
    v1::SyncRequest req;
    req.set_src_group("dev-trainer");
    req.set_dst_group("dev-infer");
    req.set_version(static_cast<uint64_t>(v));
    const bool as_delta = bench.delta && v > 1 && v % 2 == 1;  // v1: the first copy; then dense, delta, ...
    if (bench.delta && v > 1) req.mutable_options()->set_delta(as_delta ? v1::DELTA_ALWAYS : v1::DELTA_DENSE);
    v1::SyncResponse out;
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    const auto t0 = Clock::now();
    const auto st = n0.client()->Sync(&c, req, &out);
    const double t = seconds(t0, Clock::now());
    if (!st.ok()) fail("sync: " + st.error_message());
    figures.push_back(gb / t);
    // Landed in the ranks' device memory by the transport itself (cuda_ipc, GPUDirect), or staged.
    const double direct = 100.0 * static_cast<double>(out.bytes_landed_direct()) /
                          static_cast<double>(std::max<uint64_t>(1, out.network_bytes()));
    fmt::print("sync v{}: {:.3f} s = {:.2f} GB/s, {:.0f}% landed in device memory directly{}\n", v, t, gb / t, direct,
               v == 1 ? " (plans, allocates, connects)" : "");
    // Where the time went: the control plane's phases against the execute phase's copies.
    fmt::print("   gather {:.2f} ms, plan {:.2f}, prepare {:.2f}{}, execute {:.2f} ({:.2f} GB/s), finish {:.2f}\n",
               out.gather_seconds() * 1e3, out.plan_seconds() * 1e3, out.prepare_seconds() * 1e3,
               out.folded() ? " (folded)" : "", out.execute_seconds() * 1e3,
               out.execute_seconds() > 0 ? gb / out.execute_seconds() : 0.0, out.finish_seconds() * 1e3);
    if (bench.delta && v > 2) {  // v2 is the first dense sync with bases: planning, allocating
      double& best = as_delta ? best_delta : best_dense;
      best = std::max(best, gb / t);
      if (as_delta) {
        gpu_encoded += out.gpu_delta_chunks();
        gpu_rebuilt += out.gpu_rebuilt_chunks();
        fmt::print(
            "   delta: {} of {} bytes on the wire, {} chunk landings as deltas ({} encoded, {} rebuilt on "
            "a GPU), {} dense\n",
            out.wire_bytes(), out.network_bytes(), out.delta_chunks(), out.gpu_delta_chunks(), out.gpu_rebuilt_chunks(),
            out.dense_chunks());
      }
    }
  }
  int64_t bad = 0;
  for (int32_t r = 0; r < dst.world(); ++r)
    for (size_t b = 0; b < d[r].buffers.size(); ++b) {
      if (!d[r].buffers[b]) continue;
      std::vector<float> host(d[r].buffers[b]->size() / 4);
      must(testing::copyFromDevice(host.data(), d[r].buffers[b]->data(), d[r].buffers[b]->size()), "read back");
      planner::forEachElement(dst, r, [&](size_t, const planner::PieceRef& p, int64_t off, int64_t flat) {
        if (p.buffer == static_cast<int32_t>(b))
          bad += host[static_cast<size_t>(off)] != value(flat, bench.delta ? lastChange(flat / cols, syncs) : 1);
      });
    }
  double best = 0;
  for (size_t i = 1; i < figures.size(); ++i) best = std::max(best, figures[i]);
  fmt::print("RESULT sync best_cached_gbps {:.2f} wrong_elements {}\n", best, bad);
  if (bench.delta)
    fmt::print(
        "RESULT delta_sync dense_gbps {:.2f} delta_gbps {:.2f} delta_time_of_dense {:.2f} gpu_encoded {} "
        "gpu_rebuilt {}\n",
        best_dense, best_delta, best_delta > 0 ? best_dense / best_delta : 0.0, gpu_encoded, gpu_rebuilt);
  if (bad != 0) std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  int64_t mib = 512;
  int syncs = 4;
  bool sync_only = false;
  SyncBench bench;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--sync-only") {
      sync_only = true;
      continue;
    }
    if (flag == "--delta") {
      bench.delta = true;
      continue;
    }
    if (i + 1 >= argc) fail(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--mib")
      mib = std::stoll(value);
    else if (flag == "--syncs")
      syncs = std::stoi(value);
    else if (flag == "--daemons" && (value == "1" || value == "2" || value == "3"))
      bench.daemons = std::stoi(value);
    else if (flag == "--daemon-flag")
      bench.daemon_flags.push_back(value);
    else
      fail("bad flag " + flag + " " + value +
           " (--mib N, --syncs N, --daemons 1|2|3, --sync-only, --delta, --daemon-flag F: one daemon argument each)");
  }
  if (transport::cudaDeviceCount() == 0) {
    fmt::print("device_bench: no GPU here ({}): nothing to measure\n", transport::cudaUnavailableReason());
    const char* required = std::getenv("SHARDCAST_REQUIRE_GPU");  // scripts/device-check.sh
    return required != nullptr && *required != '\0' && *required != '0' ? 3 : 0;
  }
  if (!sync_only) copyFigures(mib);
  syncFigures(mib, std::max(2, syncs), bench);
  return 0;
}

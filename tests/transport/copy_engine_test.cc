// Node-local copy engine and shared-memory segments.
#include "transport/copy_engine.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "tests/support/device_buffer.h"
#include "tests/support/gpu.h"
#include "transport/cuda/cuda_support.h"
#include "transport/device_staging.h"
#include "transport/resident.h"
#include "transport/shm.h"

using namespace shardcast;
using namespace shardcast::transport;

namespace {

// Reference: element-by-element copy of a box.
void referenceCopy(std::vector<int32_t>& dst, const StridedView& dv, const std::vector<int32_t>& src,
                   const StridedView& sv, const std::vector<int64_t>& extent) {
  std::vector<int64_t> idx(extent.size(), 0);
  if (std::any_of(extent.begin(), extent.end(), [](int64_t e) { return e <= 0; })) return;
  while (true) {
    int64_t so = sv.offset, d = dv.offset;
    for (size_t k = 0; k < extent.size(); ++k) so += idx[k] * sv.strides[k], d += idx[k] * dv.strides[k];
    dst[d] = src[so];
    int k = static_cast<int>(extent.size()) - 1;
    while (k >= 0 && ++idx[k] == extent[k]) idx[k] = 0, --k;
    if (k < 0) return;
  }
}

}  // namespace

TEST_CASE("strided box copies match an element-by-element reference", "[copy]") {
  auto engine = makeHostCopyEngine();
  std::mt19937 rng(17);
  for (int it = 0; it < 300; ++it) {
    const int nd = 1 + static_cast<int>(rng() % 4);
    std::vector<int64_t> src_shape(nd), dst_shape(nd), extent(nd), so(nd), dof(nd);
    for (int d = 0; d < nd; ++d) {
      extent[d] = 1 + rng() % 5;
      src_shape[d] = extent[d] + rng() % 3;
      dst_shape[d] = extent[d] + rng() % 3;
      so[d] = rng() % (src_shape[d] - extent[d] + 1);
      dof[d] = rng() % (dst_shape[d] - extent[d] + 1);
    }
    const auto ss = denseStrides(src_shape), ds = denseStrides(dst_shape);
    const int64_t sn = std::accumulate(src_shape.begin(), src_shape.end(), int64_t{1}, std::multiplies<>());
    const int64_t dn = std::accumulate(dst_shape.begin(), dst_shape.end(), int64_t{1}, std::multiplies<>());
    std::vector<int32_t> src(sn), dst(dn, -1), expect(dn, -1);
    std::iota(src.begin(), src.end(), 0);
    StridedView sv{reinterpret_cast<std::byte*>(src.data()), MemoryKind::kHost, 0, ss};
    StridedView dv{reinterpret_cast<std::byte*>(dst.data()), MemoryKind::kHost, 0, ds};
    for (int d = 0; d < nd; ++d) sv.offset += so[d] * ss[d], dv.offset += dof[d] * ds[d];
    REQUIRE(engine->copy(dv, sv, extent, 4).ok());
    REQUIRE(engine->synchronize().ok());
    referenceCopy(expect, dv, src, sv, extent);
    REQUIRE(dst == expect);
  }
}

TEST_CASE("a dense box is copied as one run", "[copy]") {
  std::vector<int64_t> runs;
  StridedView a{nullptr, MemoryKind::kHost, 0, {12, 4, 1}}, b{nullptr, MemoryKind::kHost, 5, {12, 4, 1}};
  forEachRun(a, b, {2, 3, 4}, 2, [&](int64_t, int64_t, int64_t n) { runs.push_back(n); });
  CHECK(runs == std::vector<int64_t>{48});
  runs.clear();
  StridedView c{nullptr, MemoryKind::kHost, 0, {20, 4, 1}};  // a sub-box of a wider buffer
  forEachRun(c, b, {2, 3, 4}, 2, [&](int64_t, int64_t, int64_t n) { runs.push_back(n); });
  CHECK(runs == std::vector<int64_t>{24, 24});
}

TEST_CASE("the host engine refuses device memory and mismatched dims", "[copy]") {
  auto engine = makeHostCopyEngine();
  int x = 0, y = 0;
  StridedView h{reinterpret_cast<std::byte*>(&x), MemoryKind::kHost, 0, {1}};
  StridedView g{reinterpret_cast<std::byte*>(&y), MemoryKind::kCuda, 0, {1}};
  CHECK(engine->copy(g, h, {1}, 4).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(engine->copy(h, h, {1, 1}, 4).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("shared-memory segments: create, open from elsewhere, validate", "[shm]") {
  const std::string name = "/shardcast-test-" + std::to_string(::getpid());
  auto seg = ShmSegment::create(name, 1 << 20);
  REQUIRE(seg.ok());
  std::memset(seg->data(), 0xab, 1 << 20);
  {
    auto other = ShmSegment::open(name, 1 << 20);
    REQUIRE(other.ok());
    CHECK(static_cast<unsigned char*>(other->data())[12345] == 0xab);
  }
  CHECK(ShmSegment::create(name, 10).status().code() == absl::StatusCode::kAlreadyExists);
  auto too_big = ShmSegment::open(name, 2 << 20);
  CHECK(too_big.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(too_big.status().message()), Catch::Contains("has 1048576 bytes but 2097152 were expected"));
  {
    // Made resident (locked where allowed, every page read once): the contents are untouched.
    auto other = ShmSegment::open(name, 1 << 20);
    REQUIRE(other.ok());
    makeResident(other->data(), (1 << 20) - 100, "a test segment");
    makeResident(other->data(), 0, "nothing");
    const auto* bytes = static_cast<unsigned char*>(seg->data());
    CHECK(std::all_of(bytes, bytes + (1 << 20), [](unsigned char b) { return b == 0xab; }));
  }
  CHECK(ShmSegment::open("/shardcast-no-such-segment", 10).status().code() == absl::StatusCode::kNotFound);
  CHECK(ShmSegment::create("no-slash", 10).status().code() == absl::StatusCode::kInvalidArgument);
  *seg = std::move(*seg);  // self-move keeps the mapping
  CHECK(seg->data() != nullptr);
}

TEST_CASE("a segment truncated by its owner under an opened mapping fails its checks, the process lives", "[shm]") {
  const std::string name = "/shardcast-test-trunc-" + std::to_string(::getpid());
  constexpr size_t kBytes = 8 << 20;
  auto owner = ShmSegment::create(name, kBytes);
  REQUIRE(owner.ok());
  std::memset(owner->data(), 0x5a, kBytes);
  auto mapped = ShmSegment::open(name, kBytes);  // as the daemon maps a client's segment
  REQUIRE(mapped.ok());
  REQUIRE(mapped->checkSize().ok());
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 4096) == 0);  // the owner shrinks it
  auto size_check = mapped->checkSize();
  CHECK(size_check.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(size_check.message()), Catch::Contains("was truncated to 4096 bytes"));
  // Touched past the new end from two threads at once (a copy engine reading, a transport thread
  // writing): without the guard this is SIGBUS and the end of the process.
  auto* bytes = static_cast<unsigned char*>(mapped->data());
  unsigned sum = 0;
  std::thread writer([&] { std::memset(bytes + kBytes / 2, 0x11, kBytes / 2); });
  for (size_t i = 4096; i < kBytes; i += 4096) sum += bytes[i];
  writer.join();
  CHECK(sum < 0x5a * (kBytes / 4096));  // not the owner's bytes: zero pages (and some 0x11)
  // The owner puts the size back: the mapping stays detached from its memory and says so.
  REQUIRE(::ftruncate(fd, kBytes) == 0);
  ::close(fd);
  auto fault_check = mapped->checkSize();
  CHECK(fault_check.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(fault_check.message()), Catch::Contains("truncated by its owner while the daemon"));
  const auto* owned = static_cast<unsigned char*>(owner->data());
  CHECK(owned[kBytes - 1] == 0);  // the daemon-side writes never reached the owner's (new) pages
  // A freshly opened mapping of the restored segment is sound again (re-registration).
  auto again = ShmSegment::open(name, kBytes);
  REQUIRE(again.ok());
  CHECK(again->checkSize().ok());
  // A SIGBUS outside every guarded mapping still ends the process, as it would without the guard.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    char path[] = "/tmp/shardcast-sigbus-XXXXXX";
    const int file = ::mkstemp(path);
    ::unlink(path);
    if (file < 0 || ::ftruncate(file, 8192) != 0) ::_exit(3);
    auto* p = static_cast<volatile unsigned char*>(::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, file, 0));
    if (p == MAP_FAILED || ::ftruncate(file, 0) != 0) ::_exit(3);
    ::_exit(p[4096]);  // SIGBUS
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  // Killed by the SIGBUS (or, under ASan, whose handler comes before the default action, ended by
  // its report with a failing status); never the read completing (exit 0) or the set-up failing (3).
  INFO("child status " << status);
  CHECK_FALSE((WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 3)));
#if defined(__SANITIZE_ADDRESS__)
  constexpr bool kAsan = true;  // its report aborts the process under ASAN_OPTIONS=abort_on_error=1
#else
  constexpr bool kAsan = false;
#endif
  if (WIFSIGNALED(status)) CHECK((WTERMSIG(status) == SIGBUS || (kAsan && WTERMSIG(status) == SIGABRT)));
}

TEST_CASE("CUDA copies between host and device memory", "[gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto engine = makeCudaCopyEngine(0);
  REQUIRE(engine.ok());
  auto dev = testing::allocateDevice(1 << 20, 0);
  REQUIRE(dev.ok());
  std::vector<int32_t> host(1 << 18), back(1 << 18, 0);
  std::iota(host.begin(), host.end(), 0);
  StridedView h{reinterpret_cast<std::byte*>(host.data()), MemoryKind::kHost, 0, {512, 1}};
  StridedView d{static_cast<std::byte*>((*dev)->data()), MemoryKind::kCuda, 0, {512, 1}};
  StridedView b{reinterpret_cast<std::byte*>(back.data()), MemoryKind::kHost, 0, {512, 1}};
  REQUIRE((*engine)->copy(d, h, {512, 512}, 4).ok());
  REQUIRE((*engine)->copy(b, d, {512, 512}, 4).ok());
  REQUIRE((*engine)->synchronize().ok());
  CHECK(back == host);
  auto handle = (*dev)->ipcHandle();
  CHECK(handle.ok());
}

TEST_CASE("CUDA strided copies between device buffers (one kernel launch) match the host engine", "[gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto engine = makeCudaCopyEngine(0);
  REQUIRE(engine.ok());
  auto host_engine = makeHostCopyEngine();
  std::mt19937 rng(17);
  // Column slices of row-major tensors of every element size and alignment: many runs each.
  for (const int64_t elem : {1, 2, 4, 8})
    for (const int64_t col0 : {0, 1, 3, 8}) {
      const int64_t rows = 300, cols = 96, width = 40;
      std::vector<std::byte> src(static_cast<size_t>(rows * cols * elem));
      for (auto& b : src) b = static_cast<std::byte>(rng());
      auto dsrc = testing::allocateDevice(src.size(), 0);
      auto ddst = testing::allocateDevice(static_cast<size_t>(rows * width * elem), 0);
      REQUIRE(dsrc.ok());
      REQUIRE(ddst.ok());
      REQUIRE(testing::copyToDevice((*dsrc)->data(), src.data(), src.size()).ok());
      const StridedView from{static_cast<std::byte*>((*dsrc)->data()), MemoryKind::kCuda, col0, {cols, 1}};
      const StridedView to{static_cast<std::byte*>((*ddst)->data()), MemoryKind::kCuda, 0, {width, 1}};
      REQUIRE((*engine)->copy(to, from, {rows, width}, elem).ok());
      REQUIRE((*engine)->synchronize().ok());
      std::vector<std::byte> got(static_cast<size_t>(rows * width * elem)), expect(got.size());
      REQUIRE(testing::copyFromDevice(got.data(), (*ddst)->data(), got.size()).ok());
      REQUIRE(host_engine
                  ->copy({expect.data(), MemoryKind::kHost, 0, {width, 1}},
                         {src.data(), MemoryKind::kHost, col0, {cols, 1}}, {rows, width}, elem)
                  .ok());
      INFO("elem " << elem << ", first column " << col0);
      CHECK(got == expect);
    }
}

TEST_CASE("host memory is registered directly, never staged", "[copy]") {
  TransportOptions o;
  o.backend = "loopback";
  auto ctx = createContext(o);
  REQUIRE(ctx.ok());
  std::vector<char> buf(4096);
  auto m = TransferMemory::prepare(**ctx, buf.data(), buf.size(), MemoryKind::kHost, nullptr);
  REQUIRE(m.ok());
  CHECK_FALSE((*m)->staged());
  CHECK((*m)->region()->data() == buf.data());
  // Device memory with no copy engine cannot be staged: a precise error, not a crash.
  auto d = TransferMemory::prepare(**ctx, buf.data(), buf.size(), MemoryKind::kCuda, nullptr);
  CHECK(d.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(d.status().message()), Catch::Contains("cannot reach cuda memory"));
}

TEST_CASE("host staging for device copies: registered, and usable where it cannot be page-locked", "[copy]") {
  TransportOptions o;
  o.backend = "loopback";
  auto ctx = createContext(o);
  REQUIRE(ctx.ok());
  // Without a GPU it cannot be pinned: the region is still there, registered, whole.
  auto region = allocateHostStaging(**ctx, 1 << 16, &cudaRuntime(), "a test staging buffer");
  REQUIRE(region.ok());
  REQUIRE((*region)->size() >= (1 << 16));
  std::memset((*region)->data(), 0x3c, 1 << 16);
  CHECK(static_cast<unsigned char*>((*region)->data())[(1 << 16) - 1] == 0x3c);
  CHECK(!(*region)->remote().serialize().empty());
}

TEST_CASE("device memory the transport cannot reach is staged, and its host staging is pinned", "[gpu]") {
  SHARDCAST_SKIP_WITHOUT_GPU();
  auto ctx = createContext(TransportOptions{});
  REQUIRE(ctx.ok());
  auto engine = makeCudaCopyEngine(0);
  REQUIRE(engine.ok());
  auto dev = testing::allocateDevice(1 << 20, 0);
  REQUIRE(dev.ok());
  std::vector<unsigned char> host(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(i * 7);
  REQUIRE(testing::copyToDevice((*dev)->data(), host.data(), host.size()).ok());
  auto m = TransferMemory::prepare(**ctx, (*dev)->data(), 1 << 20, MemoryKind::kCuda, engine->get());
  REQUIRE(m.ok());
  CHECK((*m)->staged() == !(*ctx)->canAccess(MemoryKind::kCuda));
  CHECK(((*m)->region() == nullptr) == (*m)->staged());
  auto staging = allocateHostStaging(**ctx, 1 << 20, &cudaRuntime(), "a test staging buffer");
  REQUIRE(staging.ok());
  auto* out = static_cast<std::byte*>((*staging)->data());
  REQUIRE((*engine)
              ->copy({out, MemoryKind::kHost, 0, {1}},
                     {static_cast<std::byte*>((*dev)->data()), MemoryKind::kCuda, 0, {1}}, {1 << 20}, 1)
              .ok());
  auto mark = (*engine)->mark();
  REQUIRE(mark.ok());
  REQUIRE(*mark != nullptr);
  REQUIRE((*mark)->wait().ok());
  CHECK(std::memcmp(out, host.data(), host.size()) == 0);
}

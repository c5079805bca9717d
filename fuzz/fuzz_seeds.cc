// Writes the binary seed corpora of the fuzzers into DIR/register, DIR/notification and DIR/delta: valid
// messages as the code encodes them today (so that mutations start deep inside the checks), and
// a few wrong ones.   fuzz_seeds DIR
#include <filesystem>
#include <fstream>
#include <iostream>

#include "daemon/engine/delta.h"
#include "daemon/engine/notification.h"
#include "fuzz/fuzz_plan.h"
#include "planner/layout.h"
#include "transport/ucx/wire.h"

using namespace shardcast;

namespace {

void write(const std::filesystem::path& file, const std::string& bytes) {
  std::ofstream(file, std::ios::binary) << bytes;
}

v1::RegisterRequest request(const char* json, v1::Role role, uint64_t version, bool typed) {
  const v1::Layout layout = *planner::parseLayoutJson(json, "seed");
  planner::NodeTable nodes;
  const auto resolved = *planner::resolveLayout(layout, nodes);
  v1::RegisterRequest r;
  r.set_group(layout.group());
  r.set_rank(0);
  r.set_world_size(resolved.world());
  r.set_role(role);
  r.set_version(version);
  *r.mutable_layout() = layout;
  uint64_t offset = 0;
  for (const auto& [buffer, bytes] : resolved.rankBuffers(0)) {
    auto* h = r.add_buffers();
    h->set_buffer(resolved.buffer_names[static_cast<size_t>(buffer)]);
    h->mutable_shm()->set_name("/shardcast-fuzz");  // fuzz_register.cc creates it
    h->mutable_shm()->set_offset(offset);
    h->mutable_shm()->set_size(static_cast<uint64_t>(bytes));
    if (typed) h->set_dtype("float32");
    offset += (static_cast<uint64_t>(bytes) + 63) / 64 * 64;
  }
  return r;
}

// Register requests: plain, fused, strided, in pieces, double-buffered.
void writeRegisterSeeds(const std::filesystem::path& dir) {
  const char* plain = R"({"group":"g","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"w","shape":[16,16],"dtype":"float32","placements":[{"replicate":{}}]}]})";
  const char* fused = R"({"group":"f","mesh":{"shape":[2]},"nodes":["n0","n0"],"tensors":[
    {"name":"q","shape":[8,4],"dtype":"float32","placements":[{"shard":{"dim":0}}]},
    {"name":"k","shape":[4,4],"dtype":"float32","placements":[{"shard":{"dim":0}}]}],
    "fused":[{"name":"qk","dim":0,"tensors":["q","k"]}]})";
  const char* strided = R"({"group":"s","mesh":{"shape":[2,2]},"nodes":["n0","n0","n0","n0"],"tensors":[
    {"name":"w","shape":[16,8],"dtype":"float32","placements":[{"strided_shard":{"dim":0,"split_factor":2}},{"shard":{"dim":0}}]}]})";
  const char* pieces = R"({"group":"p","mesh":{"shape":[1]},"nodes":["n0"],"tensors":[
    {"name":"e","shape":[4,8],"dtype":"float32","pieces":[{"rank":0,"offsets":[0,0],"sizes":[2,8]},{"rank":0,"offsets":[2,0],"sizes":[2,8]}]}]})";
  write(dir / "register" / "destination", request(plain, v1::ROLE_DESTINATION, 0, true).SerializeAsString());
  write(dir / "register" / "source", request(plain, v1::ROLE_SOURCE, 3, false).SerializeAsString());
  write(dir / "register" / "fused", request(fused, v1::ROLE_DESTINATION, 0, true).SerializeAsString());
  write(dir / "register" / "strided", request(strided, v1::ROLE_SOURCE, 1, true).SerializeAsString());
  write(dir / "register" / "pieces", request(pieces, v1::ROLE_DESTINATION, 0, false).SerializeAsString());
  auto doubled = request(plain, v1::ROLE_DESTINATION, 0, true);
  for (auto h : doubled.buffers()) {
    h.mutable_shm()->set_offset(h.shm().offset() + 4096);
    *doubled.add_shadow_buffers() = h;
  }
  write(dir / "register" / "double-buffered", doubled.SerializeAsString());
}

// Notifications: one true chunk per wave (its transfer's first chain, the hop after the head),
// a batch of them, one with every index out of range, and a delta word.
void writeNotificationSeeds(const std::filesystem::path& dir) {
  const auto plan = fuzzing::examplePlan();
  daemon::Notification all;
  all.sync_id = "seed-sync";
  all.fence = 42;
  for (int32_t t = 0; t < static_cast<int32_t>(plan->plan.transfers.size()); ++t) {
    const auto& tr = plan->plan.transfers[static_cast<size_t>(t)];
    const auto& chain = plan->plan.chains[static_cast<size_t>(tr.chains_begin)];
    daemon::LandedChunk c{t, tr.chains_begin, chain.nodes_count > 1 ? 1 : 0, 0, 0};
    all.chunks.push_back(c);
    if (t < 4)
      write(dir / "notification" / ("chunk-" + std::to_string(t)), daemon::encodeNotification({"seed-sync", 42, {c}}));
    if (all.chunks.size() == 64) break;
  }
  write(dir / "notification" / "batch", daemon::encodeNotification(all));
  write(dir / "notification" / "out-of-range",
        daemon::encodeNotification({"seed-sync", 7, {{1 << 30, -1, 1 << 20, -5, 99}}}));
  daemon::LandedChunk d{0, plan->plan.transfers[0].chains_begin, 0, 0, daemon::LandedChunk::kDelta};
  d.bytes = 6;
  write(dir / "notification" / "delta", daemon::encodeNotification({"seed-sync", 42, {d}}));
}

// Deltas (unit 2): a real encoding applied to a base, and a pair of chunks.
void writeDeltaSeeds(const std::filesystem::path& dir) {
  std::string before(64, '\0'), now = before;
  now[2] = '\x3f';
  now[40] = '\x01';
  std::string delta(64, '\0');
  const auto size =
      daemon::encodeDelta(reinterpret_cast<const std::byte*>(now.data()), reinterpret_cast<std::byte*>(before.data()),
                          now.size(), 2, reinterpret_cast<std::byte*>(delta.data()), delta.size());
  write(dir / "delta" / "apply", std::string("\x01\x20", 2) + delta.substr(0, size.value_or(0)));
  write(dir / "delta" / "pair", std::string("\x05\x07", 2) + now + std::string(64, '\0'));
}

// UCX headers: one of each type (the first byte picks the type the receiver expects).
void writeUcxHeaderSeeds(const std::filesystem::path& dir, const transport::WriteKey& key) {
  namespace wire = transport::ucx_wire;
  write(dir / "ucx_header" / "data", std::string(1, '\0') + wire::encodeData(1, 4096, 64, key, "notice"));
  write(dir / "ucx_header" / "ack", std::string(1, '\1') + wire::encodeAck(1, 7, key));
  write(dir / "ucx_header" / "notify", std::string(1, '\2') + wire::encodeNotify(key));
}

// Peer requests (first byte: 0 Prepare, 1 Execute, 2 Finish) of the example layouts.
void writePeerSeeds(const std::filesystem::path& dir, const transport::WriteKey& key) {
  const std::string layouts = std::string(SHARDCAST_SOURCE_DIR) + "/client/examples/layouts/";
  v1::PrepareRequest prep;
  prep.set_sync_id("seed-sync");
  prep.set_fence(42);
  *prep.mutable_src() = *planner::readLayoutFile(layouts + "trainer_fsdp2_tp4.json");
  *prep.mutable_dst() = *planner::readLayoutFile(layouts + "vllm_tp4_dp2.json");
  prep.set_version(1);
  prep.set_staging_bytes(uint64_t{64} << 20);
  prep.set_chunk_bytes(uint64_t{1} << 20);
  prep.set_lease_ms(1000);
  prep.set_write_key(std::string(key.view()));
  write(dir / "peer" / "prepare", std::string(1, '\0') + prep.SerializeAsString());
  v1::ExecuteRequest exec;
  exec.set_sync_id("seed-sync");
  exec.set_fence(42);
  exec.set_wave(0);
  auto* node = exec.add_nodes();
  node->set_node("n1");
  node->set_transport_address("loopback:1");
  write(dir / "peer" / "execute", std::string(1, '\1') + exec.SerializeAsString());
  v1::FinishRequest fin;
  fin.set_sync_id("seed-sync");
  fin.set_fence(42);
  fin.set_commit(true);
  write(dir / "peer" / "finish", std::string(1, '\2') + fin.SerializeAsString());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: fuzz_seeds DIR\n";
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  for (const char* corpus : {"register", "notification", "delta", "ucx_header", "peer"})
    std::filesystem::create_directories(dir / corpus);
  writeRegisterSeeds(dir);
  writeNotificationSeeds(dir);
  writeDeltaSeeds(dir);
  const transport::WriteKey key = transport::WriteKey::random();  // the UCX headers' and the Prepare's
  writeUcxHeaderSeeds(dir, key);
  writePeerSeeds(dir, key);
  std::cout << "seeds in " << dir.string() << "\n";
  return 0;
}

// Planner at scale: a Kimi-K2-like MoE (~1T parameters: 61 layers, hidden 7168, 384 experts of
// intermediate 2048 as per-expert tensors, vocab 163840, MLA-like attention) trained on 4 replicas
// x 384 GPUs (whole experts per rank, FSDP for the dense part) and synced into 64 inference
// replicas of 16 GPUs (TP=16 attention, EP=16 experts stacked into w13/w2). Prints the figures.
//
//   build/bin/plan_bench [--layers N] [--experts N] [--dst-replicas N] [--write-layouts DIR]
#include <fmt/format.h>
#include <google/protobuf/util/json_util.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/report.h"

using namespace shardcast;
using namespace shardcast::planner;

namespace {

struct Model {
  int layers = 61;
  int experts = 384;
  int64_t hidden = 7168, inter = 2048, vocab = 163840;
  int src_replicas = 4, src_shard = 384;
  int dst_replicas = 64, dst_tp = 16;
  int ranks_per_node = 8;
};

enum class Kind { kColumn, kRow, kReplicated, kVocab };

struct Dense {
  std::string name;
  std::vector<int64_t> shape;
  Kind kind;
};

std::vector<Dense> denseTensors(const Model& m) {
  std::vector<Dense> out;
  const int64_t h = m.hidden;
  out.push_back({"model.embed_tokens.weight", {m.vocab, h}, Kind::kVocab});
  for (int l = 0; l < m.layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    // MLA (DeepSeek-V3 / Kimi-K2 shapes, 64 heads).
    out.push_back({p + "self_attn.q_a_proj.weight", {1536, h}, Kind::kReplicated});
    out.push_back({p + "self_attn.kv_a_proj_with_mqa.weight", {576, h}, Kind::kReplicated});
    out.push_back({p + "self_attn.q_a_layernorm.weight", {1536}, Kind::kReplicated});
    out.push_back({p + "self_attn.kv_a_layernorm.weight", {512}, Kind::kReplicated});
    out.push_back({p + "self_attn.q_b_proj.weight", {64 * 192, 1536}, Kind::kColumn});
    out.push_back({p + "self_attn.kv_b_proj.weight", {64 * 256, 512}, Kind::kColumn});
    out.push_back({p + "self_attn.o_proj.weight", {h, 64 * 128}, Kind::kRow});
    out.push_back({p + "input_layernorm.weight", {h}, Kind::kReplicated});
    out.push_back({p + "post_attention_layernorm.weight", {h}, Kind::kReplicated});
    out.push_back({p + "mlp.gate.weight", {m.experts, h}, Kind::kReplicated});
    out.push_back({p + "mlp.shared_experts.gate_proj.weight", {m.inter, h}, Kind::kColumn});
    out.push_back({p + "mlp.shared_experts.up_proj.weight", {m.inter, h}, Kind::kColumn});
    out.push_back({p + "mlp.shared_experts.down_proj.weight", {h, m.inter}, Kind::kRow});
  }
  out.push_back({"model.norm.weight", {h}, Kind::kReplicated});
  out.push_back({"lm_head.weight", {m.vocab, h}, Kind::kVocab});
  return out;
}

std::string expertName(int l, int e, const char* w) {
  return fmt::format("model.layers.{}.mlp.experts.{}.{}.weight", l, e, w);
}

v1::Tensor* addTensor(v1::Layout& l, const std::string& name, const std::vector<int64_t>& shape) {
  auto* t = l.add_tensors();
  t->set_name(name);
  for (int64_t s : shape) t->add_shape(s);
  t->set_dtype("bfloat16");
  return t;
}

void addPiece(v1::Tensor* t, const std::vector<int32_t>& ranks) {
  auto* p = t->add_pieces();
  for (int d = 0; d < t->shape_size(); ++d) {
    p->add_offsets(0);
    p->add_sizes(t->shape(d));
  }
  for (int32_t r : ranks) p->add_ranks(r);
}

// Trainer: mesh [replicate, shard]; dense tensors FSDP-sharded on dim 0 (HSDP), experts whole.
v1::Layout trainer(const Model& m) {
  v1::Layout l;
  l.set_group("trainer");
  l.mutable_mesh()->add_shape(m.src_replicas);
  l.mutable_mesh()->add_shape(m.src_shard);
  l.mutable_mesh()->add_dim_names("replicate");
  l.mutable_mesh()->add_dim_names("shard");
  l.set_ranks_per_node(m.ranks_per_node);
  l.set_node_prefix("trainer-");
  for (const Dense& d : denseTensors(m)) {
    auto* t = addTensor(l, d.name, d.shape);
    t->add_placements()->mutable_replicate();
    t->add_placements()->mutable_shard()->set_dim(0);
  }
  for (int layer = 0; layer < m.layers; ++layer)
    for (int e = 0; e < m.experts; ++e) {
      std::vector<int32_t> ranks;
      for (int r = 0; r < m.src_replicas; ++r) ranks.push_back(r * m.src_shard + e % m.src_shard);
      addPiece(addTensor(l, expertName(layer, e, "w1"), {m.inter, m.hidden}), ranks);
      addPiece(addTensor(l, expertName(layer, e, "w3"), {m.inter, m.hidden}), ranks);
      addPiece(addTensor(l, expertName(layer, e, "w2"), {m.hidden, m.inter}), ranks);
    }
  return l;
}

// Inference (vLLM-like): mesh [dp, tp]; attention TP, experts EP over the tp ranks, stacked into
// per-rank w13 / w2 buffers; q_a and kv_a fused as fused_qkv_a_proj.
v1::Layout inference(const Model& m) {
  v1::Layout l;
  l.set_group("inference");
  l.mutable_mesh()->add_shape(m.dst_replicas);
  l.mutable_mesh()->add_shape(m.dst_tp);
  l.mutable_mesh()->add_dim_names("dp");
  l.mutable_mesh()->add_dim_names("tp");
  l.set_ranks_per_node(m.ranks_per_node);
  l.set_node_prefix("inference-");
  for (const Dense& d : denseTensors(m)) {
    auto* t = addTensor(l, d.name, d.shape);
    t->add_placements()->mutable_replicate();
    auto* p = t->add_placements();
    switch (d.kind) {
      case Kind::kColumn:
      case Kind::kVocab:
        p->mutable_shard()->set_dim(0);
        break;
      case Kind::kRow:
        p->mutable_shard()->set_dim(1);
        break;
      case Kind::kReplicated:
        p->mutable_replicate();
        break;
    }
  }
  const int per_rank = (m.experts + m.dst_tp - 1) / m.dst_tp;
  for (int layer = 0; layer < m.layers; ++layer) {
    auto* w13 = l.add_fused();
    w13->set_name(fmt::format("model.layers.{}.mlp.experts.w13_weight", layer));
    auto* w2 = l.add_fused();
    w2->set_name(fmt::format("model.layers.{}.mlp.experts.w2_weight", layer));
    auto* qkv_a = l.add_fused();
    qkv_a->set_name(fmt::format("model.layers.{}.self_attn.fused_qkv_a_proj.weight", layer));
    qkv_a->add_tensors(fmt::format("model.layers.{}.self_attn.q_a_proj.weight", layer));
    qkv_a->add_tensors(fmt::format("model.layers.{}.self_attn.kv_a_proj_with_mqa.weight", layer));
    for (int e = 0; e < m.experts; ++e) {
      std::vector<int32_t> ranks;
      for (int r = 0; r < m.dst_replicas; ++r) ranks.push_back(r * m.dst_tp + e / per_rank);
      for (const char* w : {"w1", "w3", "w2"}) {
        addPiece(
            addTensor(l, expertName(layer, e, w), {w[1] == '2' ? m.hidden : m.inter, w[1] == '2' ? m.inter : m.hidden}),
            ranks);
        (w[1] == '2' ? w2 : w13)->add_tensors(expertName(layer, e, w));
      }
    }
  }
  return l;
}

double peakRssGiB() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / (1024.0 * 1024.0);
}

double msSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  Model m;
  std::string write_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--layers")
      m.layers = std::stoi(argv[i + 1]);
    else if (a == "--experts")
      m.experts = std::stoi(argv[i + 1]);
    else if (a == "--dst-replicas")
      m.dst_replicas = std::stoi(argv[i + 1]);
    else if (a == "--src-replicas")
      m.src_replicas = std::stoi(argv[i + 1]);
    else if (a == "--write-layouts")
      write_dir = argv[i + 1];
    else {
      fmt::print(stderr, "unknown option {}\n", a);
      return 2;
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  const v1::Layout src_proto = trainer(m), dst_proto = inference(m);
  const double gen_ms = msSince(t0);
  if (!write_dir.empty()) {
    for (const auto& [name, l] : {std::pair{"trainer.json", &src_proto}, std::pair{"inference.json", &dst_proto}}) {
      std::string json;
      (void)google::protobuf::util::MessageToJsonString(*l, &json);
      std::ofstream(write_dir + "/" + name) << json;
    }
  }

  t0 = std::chrono::steady_clock::now();
  NodeTable nodes;
  auto src = resolveLayout(src_proto, nodes);
  auto dst = resolveLayout(dst_proto, nodes);
  if (!src.ok() || !dst.ok()) {
    fmt::print(stderr, "resolve failed: {}\n", std::string((src.ok() ? dst.status() : src.status()).message()));
    return 1;
  }
  const double resolve_ms = msSince(t0);
  const double rss_before_plan = peakRssGiB();

  auto plan = makePlan(*src, *dst, nodes);
  if (!plan.ok()) {
    fmt::print(stderr, "plan failed: {}\n", std::string(plan.status().message()));
    return 1;
  }
  const PlanStats& s = plan->stats;
  const double rss = peakRssGiB();
  CostModel model;  // 400 Gbit/s NIC per node
  const double bound_egress =
      std::max<double>(static_cast<double>(s.maxIngress()), static_cast<double>(s.max_unique_held));

  fmt::print("plan_bench: Kimi-K2-like MoE, {} layers, {} experts\n", m.layers, m.experts);
  fmt::print("  source      {} ranks ({} nodes), destination {} ranks ({} nodes)\n", src->world(),
             src->world() / m.ranks_per_node, dst->world(), dst->world() / m.ranks_per_node);
  fmt::print("  tensors     {}  model {}  needed by destination ranks {}\n", s.tensors, humanBytes(s.model_bytes),
             humanBytes(s.bytes_needed));
  fmt::print("  generate    {:.0f} ms   resolve {:.0f} ms   plan {:.0f} ms (target < 2000 ms, one core)\n", gen_ms,
             resolve_ms, s.plan_ms);
  fmt::print("  peak RSS    {:.2f} GiB after resolve, {:.2f} GiB after plan (target < 2 GiB)\n", rss_before_plan, rss);
  fmt::print("  plan        {} fragments, {} transfers ({} buckets), {} chain nodes, {} network ops\n", s.fragments,
             s.transfers, s.buckets, plan->chain_nodes.size(), s.network_ops);
  fmt::print("  network     {} (lower bound {}, ratio {:.4f})\n", humanBytes(s.network_bytes),
             humanBytes(s.network_lower_bound), static_cast<double>(s.network_bytes) / s.network_lower_bound);
  fmt::print("  max node    ingress {}  egress {}  unique-held {}\n", humanBytes(s.maxIngress()),
             humanBytes(s.maxEgress()), humanBytes(s.max_unique_held));
  fmt::print("  egress      max egress / max(max ingress, unique-held) = {:.3f} (target <= 1.1)\n",
             s.maxEgress() / bound_egress);
  fmt::print("  predicted   {:.2f} s at {} Gbit/s per node; rank pull {:.2f} s ({}); gather+broadcast {:.2f} s ({})\n",
             predictSeconds(s, model), model.nic_gbps, predictPullSeconds(s, model), humanBytes(s.pull_network_bytes),
             predictGatherBroadcastSeconds(s, model), humanBytes(s.gather_bytes + s.broadcast_bytes));
  return 0;
}

// Layout JSON -> resolve -> plan. The input is one layout, or two separated by a line "---"
// (source, then destination); a single layout is planned into a copy of itself. Whatever the
// bytes, the result is a layout, a plan or an error: never a crash, a sanitizer report or an
// overflow.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "planner/layout.h"
#include "planner/plan.h"
#include "planner/report.h"

using namespace shardcast;
using namespace shardcast::planner;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto cut = text.find("\n---\n");
  auto src = parseLayoutJson(std::string(text.substr(0, cut)), "src.json");
  if (!src.ok()) return 0;
  StatusOr<v1::Layout> dst = src;
  if (cut != std::string_view::npos) {
    dst = parseLayoutJson(std::string(text.substr(cut + 5)), "dst.json");
  } else {
    dst->set_group(src->group() + "-copy");
  }
  if (!dst.ok()) return 0;
  NodeTable nodes;
  auto s = resolveLayout(*src, nodes);
  auto d = resolveLayout(*dst, nodes);
  if (!s.ok() || !d.ok()) return 0;
  if (!addScaleSources(*s, *d).ok()) return 0;
  auto plan = makePlan(*s, *d, nodes);
  if (!plan.ok()) return 0;
  // What the daemons do with a plan: where each fragment is read and written, and its report.
  for (int32_t f = 0; f < static_cast<int32_t>(plan->fragments.size()); ++f)
    for (int32_t node = 0; node < nodes.size(); ++node) (void)destinationRegions(*plan, *d, f, node);
  (void)renderJson(*plan, nodes, CostModel{});
  return 0;
}

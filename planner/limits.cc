#include "planner/limits.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include <string>

#include "common/strings.h"

namespace shardcast::planner {

namespace {

Limits& current() {
  static Limits l;
  return l;
}

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

Status walk(const Message& m, size_t max, const std::string& path) {
  const auto* refl = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  refl->ListFields(m, &fields);
  for (const FieldDescriptor* f : fields) {
    const std::string here = path.empty() ? f->name() : path + "." + f->name();
    const bool is_string = f->type() == FieldDescriptor::TYPE_STRING;
    const bool is_message = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (!is_string && !is_message) continue;
    const int n = f->is_repeated() ? refl->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      const std::string at = f->is_repeated() ? strCat(here, "[", i, "]") : here;
      if (is_string) {
        std::string scratch;
        const std::string& s = f->is_repeated() ? refl->GetRepeatedStringReference(m, f, i, &scratch)
                                                : refl->GetStringReference(m, f, &scratch);
        if (s.size() > max)
          return absl::InvalidArgumentError(strCat(at, " is ", s.size(), " bytes (at most ", max, "): ", quote(s, 60)));
      } else {
        SC_RETURN_IF_ERROR(
            walk(f->is_repeated() ? refl->GetRepeatedMessage(m, f, i) : refl->GetMessage(m, f), max, at));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

const Limits& limits() { return current(); }
void setLimits(const Limits& l) { current() = l; }

std::optional<int64_t> checkedMul(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<int64_t> checkedAdd(int64_t a, int64_t b) {
  int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

Status checkStringLengths(const Message& message, size_t max) { return walk(message, max, ""); }

}  // namespace shardcast::planner

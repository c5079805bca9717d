#include "client/lib/client.h"

#include <grpcpp/grpcpp.h>

#include <cstdlib>

#include "common/defaults.h"
#include "common/grpc_status.h"
#include "common/strings.h"

namespace shardcast {

std::string defaultDaemonTarget() {
  if (const char* a = std::getenv("SHARDCAST_ADDRESS"); a && *a) return normalizeTarget(a);
  if (const char* s = std::getenv("SHARDCAST_SOCKET"); s && *s) return normalizeTarget(s);
  return normalizeTarget(kDefaultSocket);
}

std::string normalizeTarget(const std::string& target) { return target.rfind('/', 0) == 0 ? "unix:" + target : target; }

StatusOr<Client> Client::connect(const std::string& target, std::chrono::milliseconds connect_timeout) {
  const std::string t = normalizeTarget(target);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);  // plan summaries of very large models
  auto channel = grpc::CreateCustomChannel(t, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout))
    return absl::UnavailableError(strCat("shardcastd at \"", t, "\" is not reachable (is the daemon running? set --daemon or SHARDCAST_ADDRESS)"));
  return Client(t, std::shared_ptr<v1::Shardcast::Stub>(v1::Shardcast::NewStub(channel)));
}

std::unique_ptr<grpc::ClientContext> Client::context(std::chrono::milliseconds timeout) const {
  auto c = std::make_unique<grpc::ClientContext>();
  if (timeout.count() > 0) c->set_deadline(std::chrono::system_clock::now() + timeout);
  return c;
}

StatusOr<v1::RegisterResponse> Client::registerRank(const v1::Layout& layout, int32_t rank, const HostTensors& memory) const {
  return registerRank(layout, rank, memory.handles());
}

StatusOr<v1::RegisterResponse> Client::registerRank(const v1::Layout& layout, int32_t rank,
                                                    const std::vector<v1::MemoryHandle>& buffers) const {
  // The world is the mesh's size; the daemon validates everything else against the layout.
  int64_t world = 1;
  for (const int64_t s : layout.mesh().shape()) world *= s;
  v1::RegisterRequest req;
  req.set_group(layout.group());
  req.set_rank(rank);
  req.set_world_size(static_cast<int32_t>(world));
  *req.mutable_layout() = layout;
  for (const auto& b : buffers) *req.add_buffers() = b;
  v1::RegisterResponse out;
  const auto st = stub_->Register(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("register group \"", layout.group(), "\" rank ", rank));
  return out;
}

Status Client::unregisterRank(const std::string& group, int32_t rank) const {
  v1::UnregisterRequest req;
  req.set_group(group);
  req.set_rank(rank);
  v1::UnregisterResponse out;
  return fromGrpc(stub_->Unregister(context(call_timeout_).get(), req, &out), strCat("unregister group \"", group, "\" rank ", rank));
}

StatusOr<v1::SyncResponse> Client::sync(const std::string& src, const std::string& dst, uint64_t version,
                                        const SyncOptions& options) const {
  v1::SyncRequest req;
  req.set_src_group(src);
  req.set_dst_group(dst);
  req.set_version(version);
  req.set_sync_id(options.sync_id);
  req.mutable_options()->set_timeout_ms(static_cast<uint32_t>(options.timeout.count()));
  req.mutable_options()->set_verify(options.verify);
  req.mutable_options()->set_wait_for_ranks(options.wait_for_ranks);
  // The daemon enforces the sync's own timeout; the call's deadline leaves it room to report.
  const auto limit = (options.timeout.count() > 0 ? options.timeout : std::chrono::milliseconds(300'000)) + std::chrono::seconds(30);
  v1::SyncResponse out;
  const auto st = stub_->Sync(context(limit).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("sync \"", src, "\" -> \"", dst, "\" version ", version));
  return out;
}

void WatchCancel::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  if (context_) context_->TryCancel();
}

Status Client::watch(const std::string& sync_id, const std::function<bool(const v1::SyncProgress&)>& on_progress,
                     WatchCancel* cancel) const {
  v1::WatchRequest req;
  req.set_sync_id(sync_id);
  grpc::ClientContext ctx;
  if (cancel) {
    std::lock_guard<std::mutex> lock(cancel->mu_);
    if (cancel->cancelled_) return absl::CancelledError(strCat("stopped watching sync \"", sync_id, "\""));
    cancel->context_ = &ctx;
  }
  auto reader = stub_->Watch(&ctx, req);
  v1::SyncProgress p;
  bool stopped = false;
  while (reader->Read(&p)) {
    if (!on_progress(p)) {
      stopped = true;
      ctx.TryCancel();
      break;
    }
  }
  const grpc::Status st = reader->Finish();
  if (cancel) {
    std::lock_guard<std::mutex> lock(cancel->mu_);
    cancel->context_ = nullptr;
    stopped |= cancel->cancelled_;
  }
  if (stopped) return absl::CancelledError(strCat("stopped watching sync \"", sync_id, "\""));
  return fromGrpc(st, strCat("watch sync \"", sync_id, "\""));
}

StatusOr<uint64_t> Client::waitVersion(const std::string& group, uint64_t version, std::chrono::milliseconds timeout) const {
  v1::WaitVersionRequest req;
  req.set_group(group);
  req.set_version(version);
  req.set_timeout_ms(static_cast<uint32_t>(timeout.count()));
  v1::WaitVersionResponse out;
  const auto st = stub_->WaitVersion(context(timeout + call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("wait for group \"", group, "\" version ", version));
  return out.version();
}

StatusOr<v1::StatusResponse> Client::status() const {
  v1::StatusResponse out;
  const auto st = stub_->Status(context(call_timeout_).get(), v1::StatusRequest(), &out);
  if (!st.ok()) return fromGrpc(st, "status");
  return out;
}

StatusOr<v1::ListResponse> Client::list(bool all_nodes) const {
  v1::ListRequest req;
  req.set_all_nodes(all_nodes);
  v1::ListResponse out;
  const auto st = stub_->List(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, "list");
  return out;
}

StatusOr<v1::PlanResponse> Client::plan(const std::string& src, const std::string& dst) const {
  v1::PlanRequest req;
  req.set_src_group(src);
  req.set_dst_group(dst);
  v1::PlanResponse out;
  const auto st = stub_->Plan(context(call_timeout_).get(), req, &out);
  if (!st.ok()) return fromGrpc(st, strCat("plan \"", src, "\" -> \"", dst, "\""));
  return out;
}

}  // namespace shardcast

// A test's own Peer service (a fake daemon), served on 127.0.0.1 at a free port.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>

namespace shardcast::testing {

struct ServedPeer {
  explicit ServedPeer(grpc::Service& service) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
    address = "127.0.0.1:" + std::to_string(port);
  }
  ~ServedPeer() { server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100)); }
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

}  // namespace shardcast::testing

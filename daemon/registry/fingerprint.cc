#include "daemon/registry/fingerprint.h"

#include <openssl/evp.h>

#include <cstdint>

namespace shardcast::daemon {

namespace {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void add(const void* data, size_t size) { EVP_DigestUpdate(ctx_, data, size); }
  std::string done() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_, md, &n);
    return std::string(reinterpret_cast<const char*>(md), n);
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

std::string sha256(std::string_view bytes) {
  Sha256 h;
  h.add(bytes.data(), bytes.size());
  return h.done();
}

std::string sha256OfParts(const std::vector<std::string>& parts, std::vector<std::string>* each) {
  Sha256 all;
  for (const std::string& bytes : parts) {
    const std::string one = sha256(bytes);
    const uint64_t size = bytes.size();
    all.add(&size, sizeof(size));
    all.add(one.data(), one.size());
    if (each) each->push_back(one);
  }
  return all.done();
}

}  // namespace shardcast::daemon

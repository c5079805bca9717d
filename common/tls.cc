#include "common/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>

#include "common/strings.h"

namespace shardcast {

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

Status readable(const char* what, const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError(strCat("TLS: the ", what, " file is not given"));
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(strCat("TLS: cannot read the ", what, " file ", quote(path)));
  return absl::OkStatus();
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> provider(const TlsFiles& files) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert, files.ca,
                                                                              static_cast<unsigned>(files.reload_s));
}

}  // namespace

Status TlsFiles::check() const {
  SC_RETURN_IF_ERROR(readable("certificate (--tls-cert)", cert));
  SC_RETURN_IF_ERROR(readable("private key (--tls-key)", key));
  SC_RETURN_IF_ERROR(readable("CA (--tls-ca)", ca));
  if (reload_s < 1) return absl::InvalidArgumentError("TLS: the reload interval must be at least 1 s");
  return absl::OkStatus();
}

Status TlsFiles::checkClient() const {
  SC_RETURN_IF_ERROR(readable("CA (SHARDCAST_TLS_CA)", ca));
  if (cert.empty() != key.empty())
    return absl::InvalidArgumentError(
        "TLS: give a client certificate and its key together (SHARDCAST_TLS_CERT, SHARDCAST_TLS_KEY)");
  if (!cert.empty()) {
    SC_RETURN_IF_ERROR(readable("certificate (SHARDCAST_TLS_CERT)", cert));
    SC_RETURN_IF_ERROR(readable("private key (SHARDCAST_TLS_KEY)", key));
  }
  return absl::OkStatus();
}

TlsFiles TlsFiles::fromEnv() {
  TlsFiles f;
  f.cert = env("SHARDCAST_TLS_CERT");
  f.key = env("SHARDCAST_TLS_KEY");
  f.ca = env("SHARDCAST_TLS_CA");
  return f;
}

std::shared_ptr<grpc::ChannelCredentials> channelCredentials(const TlsFiles& files, grpc::ChannelArguments* args,
                                                             const std::string& token) {
  if (!files.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider(files));
  options.watch_root_certs();
  if (!files.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  // Daemons are reached at addresses (IPs from DNS, host:port lists) that their certificates do
  // not name; what is verified is the cluster's daemon identity.
  args->SetSslTargetNameOverride(kDaemonIdentity);
  auto tls = grpc::experimental::TlsCredentials(options);
  if (token.empty()) return tls;
  return grpc::CompositeChannelCredentials(tls, grpc::AccessTokenCredentials(token));
}

std::shared_ptr<grpc::ServerCredentials> serverCredentials(const TlsFiles& files, bool require_client_cert) {
  grpc::experimental::TlsServerCredentialsOptions options(provider(files));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                                    : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

StatusOr<std::string> readToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::InvalidArgumentError(strCat("cannot read the token file ", quote(path)));
  std::string token;
  std::getline(in, token);
  // Surrounding whitespace is not part of it (as Python's str.strip() in the Python client).
  const auto first = token.find_first_not_of(" \t\r\v\f");
  token = first == std::string::npos ? "" : token.substr(first, token.find_last_not_of(" \t\r\v\f") - first + 1);
  if (token.empty()) return absl::InvalidArgumentError(strCat("the token file ", quote(path), " is empty"));
  return token;
}

StatusOr<int64_t> certificateExpiry(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "r"), &std::fclose);
  if (!file) return absl::NotFoundError(strCat("certificate ", path, ": cannot open it"));
  std::unique_ptr<X509, void (*)(X509*)> cert(PEM_read_X509(file.get(), nullptr, nullptr, nullptr), &X509_free);
  if (!cert) return absl::InvalidArgumentError(strCat("certificate ", path, ": no PEM certificate in it"));
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert.get()), &tm) != 1)
    return absl::InvalidArgumentError(strCat("certificate ", path, ": its notAfter does not parse"));
  return static_cast<int64_t>(timegm(&tm));
}

}  // namespace shardcast

// Child processes for cross-process tests: spawn with piped stdin/stdout, read lines with a
// timeout, kill, reap. Move-only; the destructor kills and reaps a child still running.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

extern char** environ;

namespace shardcast::testing {

class Child {
 public:
  // Starts argv[0] (a path) with argv; returns a child whose pid() < 0 on failure.
  static Child spawn(const std::vector<std::string>& argv) {
    Child c;
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return c;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = -1;
    if (posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    c.pid_ = pid;
    c.stdin_ = in[1];
    c.stdout_ = out[0];
    return c;
  }

  Child() = default;
  Child(Child&& o) noexcept { *this = std::move(o); }
  Child& operator=(Child&& o) noexcept {
    std::swap(pid_, o.pid_);
    std::swap(stdin_, o.stdin_);
    std::swap(stdout_, o.stdout_);
    std::swap(buffer_, o.buffer_);
    return *this;
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      wait();
    }
    if (stdin_ >= 0) ::close(stdin_);
    if (stdout_ >= 0) ::close(stdout_);
  }

  pid_t pid() const { return pid_; }

  // The next line of the child's stdout (without '\n'); empty on EOF or timeout.
  std::string readLine(std::chrono::milliseconds timeout) {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const auto nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return "";
      pollfd p{stdout_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
      char buf[4096];
      const ssize_t n = ::read(stdout_, buf, sizeof(buf));
      if (n <= 0) return "";
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }

  bool writeLine(const std::string& line) {
    const std::string s = line + "\n";
    return ::write(stdin_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
  }
  void closeStdin() {
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
  }
  void kill(int sig = SIGKILL) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  // Exit status (as from waitpid), -1 if already reaped.
  int wait() {
    if (pid_ <= 0) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string buffer_;
};

inline std::string toHex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

inline std::string fromHex(const std::string& hex) {
  std::string out;
  auto val = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(val(hex[i]) * 16 + val(hex[i + 1])));
  return out;
}

// Deterministic bytes for verification: byte i of pattern `seed` (one hash per 8 bytes).
inline uint64_t patternWord(uint64_t seed, uint64_t w) {
  uint64_t x = (w + 1) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xD1B54A32D192ED03ull;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  return x ^ (x >> 32);
}

inline unsigned char patternByte(uint64_t seed, uint64_t i) {
  return static_cast<unsigned char>(patternWord(seed, i / 8) >> (8 * (i % 8)));
}

inline void fillPattern(unsigned char* p, size_t n, uint64_t seed, uint64_t start = 0) {
  uint64_t word = patternWord(seed, start / 8);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = start + i;
    if (g % 8 == 0) word = patternWord(seed, g / 8);
    p[i] = static_cast<unsigned char>(word >> (8 * (g % 8)));
  }
}

// Index of the first byte that differs from the pattern, or n.
inline size_t checkPattern(const unsigned char* p, size_t n, uint64_t seed, uint64_t start = 0) {
  uint64_t word = patternWord(seed, start / 8);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t g = start + i;
    if (g % 8 == 0) word = patternWord(seed, g / 8);
    if (p[i] != static_cast<unsigned char>(word >> (8 * (g % 8)))) return i;
  }
  return n;
}

}  // namespace shardcast::testing

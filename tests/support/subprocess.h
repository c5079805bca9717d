// Child processes: spawn with piped stdin/stdout, read lines with a timeout, kill, reap.
// Move-only; the destructor kills and reaps a child still running. Used by the local-cluster
// demo to start daemons, and by the cross-process tests.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardcast {

// SIGSTOP, then waits until every thread of `pid` is stopped. kill() returns before the stop has
// reached each thread (a thread stops as it next returns to user space), so for a moment after it
// the process can still answer a call: a test that freezes a daemon and calls at once would see
// it answer. Throws when the threads have not all stopped within `timeout`.
inline void freezeProcess(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  ::kill(pid, SIGSTOP);
  const auto end = std::chrono::steady_clock::now() + timeout;
  const std::filesystem::path tasks = "/proc/" + std::to_string(pid) + "/task";
  while (true) {
    std::string states;
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream stat(task.path() / "stat");
      std::string line;
      std::getline(stat, line);
      const auto at = line.rfind(") ");  // the state follows the command name, which may hold ") "
      if (at != std::string::npos && at + 2 < line.size()) states += line[at + 2];
    }
    if (!states.empty() && states.find_first_not_of("tT") == std::string::npos) return;
    if (std::chrono::steady_clock::now() > end)
      throw std::runtime_error("process " + std::to_string(pid) + " did not stop (thread states \"" + states + "\")");
    ::usleep(5000);
  }
}

class Child {
 public:
  // Starts argv[0] (a path, or a name looked up in $PATH) with argv; returns once the program runs,
  // or a child whose pid() < 0 when it could not be started. The child gets SIGTERM when the
  // thread that started it exits, so daemons started by a demo or a test never outlive it, however
  // it ends (a signal, a crash, a closed pipe).
  static Child spawn(const std::vector<std::string>& argv) {
    Child c;
    if (argv.empty()) return c;
    const std::string path = findExecutable(argv[0]);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    // in/out: the child's stdin and stdout; started: closed by a successful exec (close-on-exec),
    // or carries the child's errno when it fails.
    int in[2] = {-1, -1}, out[2] = {-1, -1}, started[2] = {-1, -1};
    auto close_all = [&] {
      for (int fd : {in[0], in[1], out[0], out[1], started[0], started[1]})
        if (fd >= 0) ::close(fd);
    };
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0 || pipe2(started, O_CLOEXEC) != 0) {
      close_all();
      return c;
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid == 0) {  // the child: async-signal-safe calls only until exec
      if (::prctl(PR_SET_PDEATHSIG, SIGTERM) == 0 && ::getppid() == parent && ::dup2(in[0], 0) >= 0 &&
          ::dup2(out[1], 1) >= 0)
        ::execv(path.c_str(), args.data());
      const int err = errno;
      (void)!::write(started[1], &err, sizeof(err));
      ::_exit(127);
    }
    if (pid < 0) {
      close_all();
      return c;
    }
    // Wait for the exec: the death signal is armed before this thread may exit.
    ::close(started[1]);
    started[1] = -1;
    int err = 0;
    ssize_t n;
    while ((n = ::read(started[0], &err, sizeof(err))) < 0 && errno == EINTR) {
    }
    if (n > 0) {
      ::waitpid(pid, nullptr, 0);
      close_all();
      return c;
    }
    ::close(started[0]);
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

  // `name` itself when it holds a '/', else the first executable of that name in $PATH (looked up
  // before fork: the child may only make async-signal-safe calls).
  static std::string findExecutable(const std::string& name) {
    if (name.find('/') != std::string::npos) return name;
    const char* env = std::getenv("PATH");
    const std::string dirs = env ? env : "/usr/local/bin:/usr/bin:/bin";
    for (size_t begin = 0; begin <= dirs.size();) {
      size_t end = dirs.find(':', begin);
      if (end == std::string::npos) end = dirs.size();
      const std::string candidate = (end == begin ? std::string(".") : dirs.substr(begin, end - begin)) + "/" + name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
      begin = end + 1;
    }
    return name;
  }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int stdout_ = -1;
  std::string buffer_;
};

}  // namespace shardcast

// `shardcast`: the command-line client. Subcommands live in their own files.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "client/cli/daemon_commands.h"
#include "client/cli/exit_codes.h"
#include "client/cli/plan_command.h"
#include "common/defaults.h"

namespace {

// The subcommand nearest to `typed` (edit distance at most 2), or "".
std::string closestCommand(CLI::App& app, const std::string& typed) {
  std::string best;
  size_t best_distance = 3;
  for (const CLI::App* c : app.get_subcommands([](CLI::App*) { return true; })) {
    const std::string& name = c->get_name();
    std::vector<size_t> row(name.size() + 1);
    for (size_t j = 0; j <= name.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= typed.size(); ++i) {
      size_t diagonal = row[0];
      row[0] = i;
      for (size_t j = 1; j <= name.size(); ++j) {
        const size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (typed[i - 1] == name[j - 1] ? 0 : 1)});
        diagonal = up;
      }
    }
    if (row[name.size()] < best_distance) {
      best_distance = row[name.size()];
      best = name;
    }
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardcast: weight sync between differently sharded GPU groups"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("shardcast ") + shardcast::kShardcastVersion);
  int exit_code = shardcast::cli::kOk;
  shardcast::cli::addPlanCommand(app, &exit_code);
  shardcast::cli::addDaemonCommands(app, &exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // A mistyped subcommand: say which it was and the closest one, not only "A subcommand is required".
    if (argc > 1 && argv[1][0] != '-' &&
        app.get_subcommands([&](CLI::App* c) { return c->check_name(argv[1]); }).empty()) {
      std::cerr << "shardcast: no command \"" << argv[1] << "\"";
      if (const std::string near = closestCommand(app, argv[1]); !near.empty())
        std::cerr << "; did you mean \"" << near << "\"?";
      std::cerr << "\nRun with --help for the commands.\n";
      return shardcast::cli::kUsage;
    }
    app.exit(e);
    return shardcast::cli::kUsage;
  }
  return exit_code;
}

// `shardcast`: the command-line client. Subcommands live in their own files.
#include <CLI/CLI.hpp>
#include <iostream>

#include "client/cli/daemon_commands.h"
#include "client/cli/exit_codes.h"
#include "client/cli/plan_command.h"
#include "common/defaults.h"

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
    app.exit(e);
    return shardcast::cli::kUsage;
  }
  return exit_code;
}

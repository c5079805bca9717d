// `shardcast sync | watch | status | layouts | wait | health`: the commands that talk to a running shardcastd
// through shardcast::Client. Every one takes --daemon (default: the local socket) and --json.
#pragma once

#include <CLI/CLI.hpp>

namespace shardcast::cli {

// Adds the subcommands; when one runs, its exit code is written to *exit_code.
void addDaemonCommands(CLI::App& app, int* exit_code);

}  // namespace shardcast::cli

// `shardcast plan`: plan a sync between two layout files and print its summary.
#pragma once

#include <CLI/CLI.hpp>

namespace shardcast::cli {

// Adds the subcommand; when it runs, its exit code is written to *exit_code.
void addPlanCommand(CLI::App& app, int* exit_code);

}  // namespace shardcast::cli

// Output: the tables, printed row by row as each measurement finishes, and the JSON file.
#pragma once

#include "common.hpp"
#include "measure.hpp"
#include "workloads.hpp"

#include <string>
#include <vector>

namespace bench {

// What the JSON says of the run besides its results.
struct Meta {
  std::string version, rev, backend, device, date, command;
};

void print_decode_header();
void print_decode_row(const DecodeResult &r);

// What the default run leaves to --full, by workload group (nothing when it leaves nothing).
void print_left_to_full(const std::vector<Workload> &run, const std::string &filter);

void print_append_header();
void print_append_row(const AppendResult &r);

void print_overhead_header();
void print_overhead_row(const OverheadResult &r);

void print_transfer_header();
void print_transfer_row(const TransferResult &r);

void print_extend_header();
void print_extend_row(const ExtendResult &r);

void write_json(const char *path, const Env &e, const Meta &m, const std::vector<DecodeResult> &dec,
                const std::vector<AppendResult> &app, const std::vector<OverheadResult> &ovh,
                const std::vector<TransferResult> &xfer, const std::vector<ExtendResult> &ext);

} // namespace bench

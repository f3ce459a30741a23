// Runs the core's tests: core_tests [--seed N] [--stress-blocks N] [NAME_SUBSTRING]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "check.h"

int main(int argc, char** argv) {
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--seed" && i + 1 < argc) {
      check::Opts().seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--stress-blocks" && i + 1 < argc) {
      check::Opts().stress_blocks = std::strtoll(argv[++i], nullptr, 10);
    } else if (!arg.empty() && arg[0] != '-') {
      filter = arg;
    } else {
      std::fprintf(stderr, "usage: %s [--seed N] [--stress-blocks N] [NAME_SUBSTRING]\n", argv[0]);
      return 2;
    }
  }
  // The seed is printed so that a failure can be replayed with --seed.
  std::printf("seed %llu, stress blocks %lld\n", static_cast<unsigned long long>(check::Opts().seed),
              static_cast<long long>(check::Opts().stress_blocks));
  int ran = 0;
  for (const check::Test& test : check::Registry()) {
    if (!filter.empty() && std::string(test.name).find(filter) == std::string::npos) continue;
    std::printf("[ RUN  ] %s\n", test.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    test.fn();  // a failed CHECK aborts the process
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("[  OK  ] %s (%.2f s)\n", test.name, s);
    ++ran;
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test matches '%s'\n", filter.c_str());
    return 1;
  }
  std::printf("%d tests passed\n", ran);
  return 0;
}

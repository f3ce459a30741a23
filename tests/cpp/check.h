// A tiny test harness for the core: CHECK macros and a test registry.
//
// No gtest: the core is two files with no dependencies, and its tests
// should build with one g++ line (tests/cpp/run.sh), sanitizers included.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

namespace check {

// Abort rather than exit: under a sanitizer or a debugger the abort shows
// the stack of the failing thread, and a CHECK in a backend thread stops the
// whole process instead of leaving the scheduler waiting on it.
[[noreturn]] inline void Fail(const char* file, int line, const std::string& what) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}

struct Test {
  const char* name;
  void (*fn)();
};

inline std::vector<Test>& Registry() {
  static std::vector<Test> tests;
  return tests;
}

struct Register {
  Register(const char* name, void (*fn)()) { Registry().push_back({name, fn}); }
};

// Options the runner sets from its command line (main.cc).
struct Options {
  uint64_t seed = 1;
  int64_t stress_blocks = 200000;  // blocks through the threaded stress test, at least
};

inline Options& Opts() {
  static Options options;
  return options;
}

}  // namespace check

#define CHECK(cond)                                        \
  do {                                                     \
    if (!(cond)) ::check::Fail(__FILE__, __LINE__, #cond); \
  } while (0)

#define CHECK_MSG(cond, msg)                              \
  do {                                                    \
    if (!(cond)) {                                        \
      std::ostringstream check_os_;                       \
      check_os_ << #cond << ": " << msg;                  \
      ::check::Fail(__FILE__, __LINE__, check_os_.str()); \
    }                                                     \
  } while (0)

#define CHECK_EQ(a, b)                                                       \
  do {                                                                       \
    const auto check_a_ = (a);                                               \
    const auto check_b_ = (b);                                               \
    if (!(check_a_ == check_b_)) {                                           \
      std::ostringstream check_os_;                                          \
      check_os_ << #a " == " #b " (" << check_a_ << " vs " << check_b_ << ")"; \
      ::check::Fail(__FILE__, __LINE__, check_os_.str());                    \
    }                                                                        \
  } while (0)

// `expr` must throw `Type` whose what() contains `substr`.
#define CHECK_THROWS(expr, Type, substr)                                                          \
  do {                                                                                            \
    bool check_thrown_ = false;                                                                   \
    try {                                                                                         \
      expr;                                                                                       \
    } catch (const Type& check_e_) {                                                              \
      check_thrown_ = true;                                                                       \
      const std::string check_what_ = check_e_.what();                                            \
      CHECK_MSG(check_what_.find(substr) != std::string::npos,                                    \
                "message '" << check_what_ << "' lacks '" << substr << "'");                     \
    }                                                                                             \
    CHECK_MSG(check_thrown_, #expr " did not throw " #Type);                                      \
  } while (0)

#define TEST(name)                                                \
  static void name();                                             \
  static const ::check::Register name##_registered_(#name, name); \
  static void name()

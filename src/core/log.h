// Logging and progress to stderr. stdout is reserved for results (one JSON object with --json).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace kd {

enum class LogLevel { quiet = 0, info = 1, debug = 2 };
void set_log_level(LogLevel l);
LogLevel log_level();
void log_line(LogLevel l, const std::string& s);

template <class... A>
void log_info(const A&... parts) { if (log_level() >= LogLevel::info) log_line(LogLevel::info, cat(parts...)); }
template <class... A>
void log_debug(const A&... parts) { if (log_level() >= LogLevel::debug) log_line(LogLevel::debug, cat(parts...)); }

// A one-line progress bar on stderr (redrawn with \r when stderr is a terminal, otherwise a plain line
// at every 10 % and at least every 10 s), for anything slow: loading weights, writing models, building
// fixtures. unit "B": bytes, shown as MB or GB with the rate so far and the time left (ETA). A job
// that ends within KDTREE_PROGRESS_MIN_S seconds (default 0.5) prints nothing.
class Progress {
 public:
  Progress(std::string label, uint64_t total, std::string unit = "");
  ~Progress();
  void add(uint64_t n);
  void finish();

 private:
  void draw(bool final);
  std::string label_, unit_;
  uint64_t total_, done_ = 0;
  int last_decile_ = -1;
  bool tty_, finished_ = false, drawn_ = false;
  std::chrono::steady_clock::time_point t0_, last_draw_;
};

// Seconds since an arbitrary epoch, for timing summaries.
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace kd

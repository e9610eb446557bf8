#include "core/log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace kd {

namespace {
LogLevel g_level = LogLevel::info;

// KDTREE_PROGRESS_MIN_S: seconds a job runs before its bar appears (default 0.5; tests set 0 to see the
// bar of a quick job).
double progress_min_s() {
  static const double v = [] {
    const char* e = std::getenv("KDTREE_PROGRESS_MIN_S");
    char* end = nullptr;
    const double d = e ? std::strtod(e, &end) : 0.5;
    return e && end != e && d >= 0 ? d : 0.5;
  }();
  return v;
}
}  // namespace

void set_log_level(LogLevel l) { g_level = l; }
LogLevel log_level() { return g_level; }
void log_line(LogLevel, const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); }

Progress::Progress(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), tty_(isatty(STDERR_FILENO) != 0),
      t0_(std::chrono::steady_clock::now()), last_draw_(t0_) {}

Progress::~Progress() { finish(); }

void Progress::add(uint64_t n) {
  done_ += n;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  draw(true);
}

void Progress::draw(bool final) {
  if (log_level() < LogLevel::info) return;
  auto now = std::chrono::steady_clock::now();
  const double secs = std::chrono::duration<double>(now - t0_).count();
  // Quick jobs stay silent: a bar appears only once a job has run for half a second.
  if (secs < progress_min_s() && !drawn_) return;
  double frac = total_ ? double(done_) / double(total_) : 1.0;
  if (frac > 1) frac = 1;
  const int decile = int(frac * 10);
  if (!final) {
    if (tty_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    // Not a terminal: a line at every tenth, and at least one every 10 s of a slow job.
    if (!tty_ && decile == last_decile_ && now - last_draw_ < std::chrono::seconds(10)) return;
  } else if (!tty_ && decile == last_decile_ && done_ >= total_) {
    return;  // the last line already says 100 %
  }
  drawn_ = true;
  last_draw_ = now;
  last_decile_ = decile;
  constexpr int kWidth = 30;
  std::string bar(static_cast<size_t>(frac * kWidth), '#');
  bar.resize(kWidth, '.');
  char amount[128];
  if (unit_ == "B") {
    // Bytes: GB past a gigabyte (MB below), the rate so far and, while running, the time left at it.
    const bool big = total_ >= 1000000000ull;
    const double scale = big ? 1e9 : 1e6, rate = secs > 0 ? double(done_) / secs : 0.0;
    const char* u = big ? "GB" : "MB";
    char eta[48] = "";
    if (!final && rate > 0 && done_ < total_) std::snprintf(eta, sizeof eta, ", ETA %.0fs", double(total_ - done_) / rate);
    std::snprintf(amount, sizeof amount, big ? "%.2f / %.2f %s, %.2f %s/s%s" : "%.1f / %.1f %s, %.0f %s/s%s", double(done_) / scale,
                  double(total_) / scale, u, rate / scale, u, eta);
  } else {
    std::snprintf(amount, sizeof amount, "%llu / %llu %s", (unsigned long long)done_, (unsigned long long)total_, unit_.c_str());
  }
  std::fprintf(stderr, "%s%s [%s] %5.1f%% %s, %.1fs%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(), frac * 100, amount,
               secs, (final || !tty_) ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace kd

#include "core/log.h"

#include <unistd.h>

#include <cstdio>

namespace kd {

namespace {
LogLevel g_level = LogLevel::info;
}

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
  if (secs < 0.5 && !drawn_) return;
  double frac = total_ ? double(done_) / double(total_) : 1.0;
  if (frac > 1) frac = 1;
  const int decile = int(frac * 10);
  if (!final) {
    if (tty_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    if (!tty_ && decile == last_decile_) return;
  } else if (!tty_ && decile == last_decile_) {
    return;  // the last line already says 100 %
  }
  drawn_ = true;
  last_draw_ = now;
  last_decile_ = decile;
  constexpr int kWidth = 30;
  std::string bar(static_cast<size_t>(frac * kWidth), '#');
  bar.resize(kWidth, '.');
  char amount[96];
  if (unit_ == "B")
    std::snprintf(amount, sizeof amount, "%.1f / %.1f MB, %.0f MB/s", double(done_) / 1e6, double(total_) / 1e6,
                  secs > 0 ? double(done_) / 1e6 / secs : 0.0);
  else
    std::snprintf(amount, sizeof amount, "%llu / %llu %s", (unsigned long long)done_, (unsigned long long)total_, unit_.c_str());
  std::fprintf(stderr, "%s%s [%s] %5.1f%% %s, %.1fs%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(), frac * 100, amount,
               secs, (final || !tty_) ? "\n" : "");
  std::fflush(stderr);
}

}  // namespace kd

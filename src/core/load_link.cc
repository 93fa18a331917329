// The load path's fluid model (load_link.h). The arithmetic is the replay's,
// to the bit: a step moves (t - now) * bandwidth / ticks / n bytes of each
// transfer served, and the next end is now + least * n * ticks / bandwidth,
// in that order of operations, so that the replay's results do not change.
#include "modelcache/core/load_link.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace modelcache {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Less than half a byte left is rounding: done.
constexpr double kDoneBytes = 0.5;

}  // namespace

LoadLink::LoadLink(double bytes_per_second, double ticks_per_second)
    : bytes_per_second_(bytes_per_second),
      ticks_per_second_(ticks_per_second) {}

bool LoadLink::Add(uint64_t id, uint64_t bytes, Class c) {
  const double b = static_cast<double>(bytes);
  if (!std::isfinite(bytes_per_second_) || b <= kDoneBytes) return false;
  (c == Class::kForeground ? foreground_ : background_)
      .push_back(Transfer{id, b});
  return true;
}

void LoadLink::Promote(uint64_t id) {
  const auto it = std::find_if(background_.begin(), background_.end(),
                               [id](const Transfer& t) { return t.id == id; });
  if (it == background_.end()) return;
  foreground_.push_back(*it);
  background_.erase(it);
}

void LoadLink::Remove(uint64_t id) {
  const auto is = [id](const Transfer& t) { return t.id == id; };
  std::erase_if(foreground_, is);
  std::erase_if(background_, is);
}

void LoadLink::Clear() {
  foreground_.clear();
  background_.clear();
}

void LoadLink::AdvanceTo(double t) {
  if (t <= now_) return;
  std::vector<Transfer>& served =
      foreground_.empty() ? background_ : foreground_;
  if (!served.empty()) {
    const double moved = (t - now_) * bytes_per_second_ / ticks_per_second_ /
                         static_cast<double>(served.size());
    for (Transfer& transfer : served) transfer.remaining -= moved;
  }
  now_ = t;
}

bool LoadLink::IsDone(double remaining, size_t sharing) const {
  // The second test is what the clock cannot move: the time it would take
  // is lost when added to now (see the header).
  return remaining <= kDoneBytes ||
         now_ + remaining * static_cast<double>(sharing) * ticks_per_second_ /
                     bytes_per_second_ <=
             now_;
}

std::vector<uint64_t> LoadLink::TakeDone() {
  std::vector<Transfer>& served =
      foreground_.empty() ? background_ : foreground_;
  const size_t sharing = served.size();
  std::vector<uint64_t> done;
  for (size_t k = 0; k < served.size();) {
    if (IsDone(served[k].remaining, sharing)) {
      done.push_back(served[k].id);
      served[k] = served.back();
      served.pop_back();
    } else {
      ++k;
    }
  }
  return done;
}

size_t LoadLink::Advance(double t) {
  size_t ended = 0;
  for (double end = RunOut(); end <= t; end = RunOut()) {
    AdvanceTo(end);
    ended += TakeDone().size();
  }
  AdvanceTo(t);
  return ended;
}

double LoadLink::Least() const {
  double least = kInf;
  for (const Transfer& transfer : Served()) {
    least = std::min(least, transfer.remaining);
  }
  return least;
}

double LoadLink::RunOut() const {
  const size_t sharing = Served().size();
  if (sharing == 0) return kInf;
  return now_ + Least() * static_cast<double>(sharing) * ticks_per_second_ /
                    bytes_per_second_;
}

double LoadLink::NextEnd() const {
  const size_t sharing = Served().size();
  if (sharing == 0) return kInf;
  return IsDone(Least(), sharing) ? now_ : RunOut();
}

bool LoadLink::Done(uint64_t id) const {
  const auto is = [id](const Transfer& t) { return t.id == id; };
  return std::none_of(foreground_.begin(), foreground_.end(), is) &&
         std::none_of(background_.begin(), background_.end(), is);
}

}  // namespace modelcache

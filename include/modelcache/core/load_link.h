// The load path's link as a fluid model: transfers that share one bandwidth
// equally (processor sharing: with n transfers moving, each moves at
// bandwidth / n, and one that ends speeds the others up from then on).
//
// Two callers run this same code: the replay's simulation (src/replay/
// engine.cc), in trace time, and the daemon's load throttle
// (src/serve/throttle.h), on the steady clock, so that a live daemon's
// loads take the time the replay gives them.
//
// A LoadLink keeps no clock: its caller moves it to a time (AdvanceTo, or
// Advance, which also ends what finishes on the way) and asks it when the
// next transfer ends (NextEnd). Times are in the caller's unit, given as
// ticks per second (1000 for milliseconds). It is not thread-safe.
//
// Classes. A background transfer (a prewarm) moves only while no foreground
// transfer (a load a request waits for) is moving; the foreground ones then
// have the whole bandwidth. Promote() makes a background transfer a
// foreground one, with the bytes it has left.
//
// When a transfer is done: when less than half a byte is left (rounding),
// or when what is left is less than the clock can move. Late on a clock (in
// milliseconds from 2^32, 50 days, at 2 GB/s), a double's step of time
// moves more than a byte, so a transfer could be left with bytes that no
// representable step reaches; it is done instead of never.
#ifndef MODELCACHE_CORE_LOAD_LINK_H_
#define MODELCACHE_CORE_LOAD_LINK_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace modelcache {

class LoadLink {
 public:
  enum class Class : uint8_t { kForeground, kBackground };

  // REQUIRES: bytes_per_second > 0 (+inf: every transfer is done at once);
  // ticks_per_second > 0, the caller's unit of time.
  explicit LoadLink(double bytes_per_second, double ticks_per_second = 1);

  // A transfer of `bytes` joins at the link's time (that of the last
  // AdvanceTo or Advance). Returns false, and adds nothing, when it is done
  // at once: no bytes to move (under half a byte), or no bandwidth limit.
  // REQUIRES: `id` is not on the link.
  bool Add(uint64_t id, uint64_t bytes, Class c = Class::kForeground);
  // The background transfer `id` becomes a foreground one; nothing when it
  // is not a background transfer on the link.
  void Promote(uint64_t id);
  // Forgets a transfer (a load abandoned or cancelled); nothing when it is
  // not on the link.
  void Remove(uint64_t id);
  // Forgets every transfer; the time stays.
  void Clear();

  // Two ways to drive it. A caller that steps from one event to the next
  // (the replay) moves it with AdvanceTo to each, to NextEnd() among them,
  // and ends what is done with TakeDone(): a transfer within half a byte of
  // its end when the caller looks is done then. A caller on a real clock
  // (the throttle) calls Advance(now), which ends each transfer at the end
  // of its bytes, RunOut(), and waits until the next one.

  // Moves the transfers being served on by (t - the link's time) at their
  // share, and the link's time to t; earlier times are ignored. Ends none.
  // REQUIRES: no transfer ends before t (t <= NextEnd()), or the share is
  // wrong from that end on.
  void AdvanceTo(double t);
  // The transfers being served that are done now, taken off the link (in
  // no particular order).
  std::vector<uint64_t> TakeDone();
  // When the next transfer ends if none joins or leaves: the link's time
  // when one is done already, else RunOut(); +inf when none moves.
  double NextEnd() const;

  // Advances to `t` piecewise: to each RunOut() on the way, ending there
  // the transfers done, so that the rest speed up from then on. Returns how
  // many ended.
  size_t Advance(double t);
  // When the transfer with the fewest bytes left runs out of them if none
  // joins or leaves; +inf when none moves.
  double RunOut() const;

  // Whether `id` is not on the link (done, removed, or never added).
  bool Done(uint64_t id) const;
  // The transfers on the link, and those of one class.
  size_t moving() const { return foreground_.size() + background_.size(); }
  size_t moving(Class c) const { return ListOf(c).size(); }
  // The link's time.
  double now() const { return now_; }

 private:
  struct Transfer {
    uint64_t id;
    double remaining;  // bytes
  };

  const std::vector<Transfer>& ListOf(Class c) const {
    return c == Class::kForeground ? foreground_ : background_;
  }
  // The transfers moving now: the foreground ones, or the background ones
  // when there are none.
  const std::vector<Transfer>& Served() const {
    return foreground_.empty() ? background_ : foreground_;
  }
  bool IsDone(double remaining, size_t sharing) const;
  // The fewest bytes left among the transfers served.
  double Least() const;

  const double bytes_per_second_;
  const double ticks_per_second_;
  double now_ = 0;
  std::vector<Transfer> foreground_, background_;
};

}  // namespace modelcache

#endif  // MODELCACHE_CORE_LOAD_LINK_H_

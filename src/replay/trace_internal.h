// What the trace readers share beyond csv.h: a source collected into memory.
#ifndef MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_
#define MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_

#include "modelcache/replay/replay.h"

namespace modelcache::replay {

// Every request of one pass over `source`, with its header's models and
// sizes: the in-memory trace the source stands for. Throws what the pass
// throws, and TraceError if the pass gives more or fewer requests than the
// header says.
Trace CollectTrace(const TraceSource& source);

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_TRACE_INTERNAL_H_

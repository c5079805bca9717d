// A memory policy, separate from where memory comes from: keep what the daemon moves bytes through
// resident and its page tables filled (shm segments of ranks, landing arenas).
#pragma once

#include <cstddef>
#include <string>

namespace shardcast::transport {

// Makes memory the daemon moves bytes through ready for a sync: locks it with mlock(2), so the
// kernel neither reclaims nor unmaps its pages (proactive reclaim, e.g. DAMON's pageout scheme,
// unmaps pages that sat idle between syncs even without swap), and reads every page once from user
// and once from kernel mode, so the first sync does not pay this process's first touch of each
// page (under virtualisation with shadow page tables that costs ~9 us per 4 KiB page and mode even
// after MAP_POPULATE: 2.3 s per GiB and mode on the development VM; one read per page elsewhere).
// `data` is page-aligned (a mapping). Locking needs CAP_IPC_LOCK or a large enough
// RLIMIT_MEMLOCK: without them the memory stays unlocked (still correct, slower after idle
// periods) and one warning per process says so. Returns whether the memory is locked.
bool makeResident(void* data, size_t size, const std::string& what);

}  // namespace shardcast::transport

// The sync attempt's state machine and the table of attempts, without a daemon: each transition,
// what each phase refuses, what a close may commit, and what the table lets a peer or coordinator
// reach. The syncs that drive them end to end are in sync_test.cc and contract_test.cc.
#include "daemon/engine/sync_attempt.h"

#include <catch2/catch.hpp>
#include <thread>

using namespace shardcast::daemon;
using Phase = SyncAttempt::Phase;
using End = Registry::SyncEnd;

namespace {

// An attempt of a plan with `waves` waves in which this node (node 0) expects `incoming` chunk
// landings per wave.
std::shared_ptr<SyncAttempt> attempt(const std::string& id, uint64_t fence, int32_t waves = 1,
                                     std::vector<int64_t> incoming = {0}) {
  auto plan = std::make_shared<CachedPlan>();
  plan->waves = waves;
  plan->per_node.resize(1);
  plan->per_node[0].incoming = std::move(incoming);
  auto a = std::make_shared<SyncAttempt>();
  a->id = id;
  a->fence = fence;
  a->dst_group = "infer";
  a->plan = plan;
  a->self = 0;
  return a;
}

}  // namespace

TEST_CASE("sync attempt: prepared, executing and back, then closing and closed", "[daemon][attempt]") {
  auto a = attempt("s", 3);
  CHECK(a->phase() == Phase::kPreparing);
  CHECK(!a->usable().ok());  // not reachable before it is published
  a->publish();
  CHECK(a->phase() == Phase::kPrepared);
  CHECK(a->usable().ok());

  REQUIRE(a->beginExecute("n0").ok());
  CHECK(a->phase() == Phase::kExecuting);
  // One wave at a time: a retried Execute while one runs is refused, naming the node.
  const auto second = a->beginExecute("n0");
  CHECK(second.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(second.message()).find("already running on node \"n0\"") != std::string::npos);
  a->endExecute(0, true);
  CHECK(a->phase() == Phase::kPrepared);

  CHECK(a->beginClose(End::kCommit, "n0", "") == End::kCommit);  // the one wave ran, nothing was to land
  CHECK(a->phase() == Phase::kClosing);
  CHECK(a->usable().code() == absl::StatusCode::kAborted);
  CHECK(a->beginExecute("n0").code() == absl::StatusCode::kAborted);  // no wave after the end
  CHECK(a->quiesce(std::chrono::seconds(1)));
  a->endClose();
  CHECK(a->phase() == Phase::kClosed);
}

TEST_CASE("sync attempt: a commit becomes dirty for a wave not executed or a chunk not landed", "[daemon][attempt]") {
  SECTION("a wave missing") {
    auto a = attempt("s", 3, 2, {0, 0});
    a->publish();
    REQUIRE(a->beginExecute("n0").ok());
    a->endExecute(0, true);
    REQUIRE(a->beginExecute("n0").ok());
    a->endExecute(1, false);  // wave 1 failed here
    CHECK(a->beginClose(End::kCommit, "n0", "") == End::kDirty);
    const std::string why(a->failure().message());
    CHECK(why.find("commit refused on node \"n0\": wave(s) 1 of 2 not executed here") != std::string::npos);
  }
  SECTION("a chunk missing") {
    auto a = attempt("s", 3, 1, {2});
    a->publish();
    REQUIRE(a->beginExecute("n0").ok());
    CHECK(a->landOnce(0, 0));
    CHECK(!a->landOnce(0, 0));  // a repeat is refused
    a->endExecute(0, true);
    CHECK(a->beginClose(End::kCommit, "n0", "") == End::kDirty);
    CHECK(std::string(a->failure().message()).find("1 of the 2 chunks planned to land here") != std::string::npos);
  }
  SECTION("a write failed after its execute returned") {
    auto a = attempt("s", 3);
    a->publish();
    a->fail(absl::UnavailableError("peer gone"));
    CHECK(a->beginClose(End::kCommit, "n0", "") == End::kDirty);
    CHECK(a->failure().message() == "peer gone");  // the first failure is kept
  }
  SECTION("an abort keeps its reason") {
    auto a = attempt("s", 3);
    a->publish();
    CHECK(a->beginClose(End::kRevert, "n0", "coordinator gave up") == End::kRevert);
    CHECK(a->failure().code() == absl::StatusCode::kAborted);
    CHECK(std::string(a->failure().message()).find("coordinator gave up") != std::string::npos);
  }
}

TEST_CASE("sync attempt: a close during an execute waits for it, and the wave does not count", "[daemon][attempt]") {
  auto a = attempt("s", 3);
  a->publish();
  REQUIRE(a->beginExecute("n0").ok());
  CHECK(a->beginClose(End::kDirty, "n0", "lease ran out") == End::kDirty);
  CHECK(a->phase() == Phase::kClosing);
  CHECK(a->executing());
  CHECK(!a->quiesce(std::chrono::seconds(0)));  // the execute still runs
  CHECK(a->takeMemory().first == nullptr);
  std::thread execute([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    a->endExecute(0, true);
  });
  CHECK(a->quiesce(std::chrono::seconds(30)));
  execute.join();
  CHECK(a->phase() == Phase::kClosing);  // counted out, not back to prepared
  CHECK(!a->executing());
  a->drain(false);
  CHECK(a->phase() == Phase::kDraining);
  CHECK(!a->drainsReading());
  a->endClose();
  CHECK(a->phase() == Phase::kClosed);
}

TEST_CASE("sync attempt: landed chunks reach the executing thread, a failure wakes it", "[daemon][attempt]") {
  auto a = attempt("s", 3);
  a->publish();
  const auto soon = SyncAttempt::Clock::now() + std::chrono::milliseconds(10);
  auto next = a->nextLanded(soon, false);
  REQUIRE(next.ok());
  CHECK(next->kind == SyncAttempt::Next::kTimedOut);
  a->announce({LandedChunk{1, 0, 0, 4}});
  next = a->nextLanded(soon, false);
  REQUIRE(next.ok());
  REQUIRE(next->kind == SyncAttempt::Next::kChunk);
  CHECK(next->chunk.transfer == 1);
  CHECK(next->chunk.chunk == 4);
  next = a->nextLanded(soon, true);  // all processed and no write pending
  REQUIRE(next.ok());
  CHECK(next->kind == SyncAttempt::Next::kDone);
  std::thread failer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    a->fail(absl::DataLossError("bad chunk"));
  });
  next = a->nextLanded(SyncAttempt::Clock::now() + std::chrono::seconds(30), false);
  failer.join();
  CHECK(next.status().code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("attempt table: one open attempt per id, reachable only once prepared", "[daemon][attempt]") {
  AttemptTable table("n0");
  auto a = attempt("s", 3);
  REQUIRE(table.begin(a).ok());
  CHECK(table.begin(attempt("s", 5)).status().code() == absl::StatusCode::kAlreadyExists);
  CHECK(table.find("s") == nullptr);  // preparing: no peer or coordinator reaches it yet
  REQUIRE(table.publish(a).ok());
  CHECK(table.find("s") == a);
  CHECK(table.find("s", 3) == a);
  CHECK(table.find("s", 4) == nullptr);  // another attempt's fence
  CHECK(table.takeForClose("s", 3) == a);
  CHECK(table.find("s") == nullptr);
  // Closed here: a new attempt of the id may be prepared while the old one closes.
  CHECK(table.begin(attempt("s", 5)).ok());
}

TEST_CASE("attempt table: a retry of the same Sync call takes over from the earlier attempt its abort missed",
          "[daemon][attempt]") {
  using std::chrono::milliseconds;
  AttemptTable table("n0");
  auto first = attempt("s", 3);
  REQUIRE(table.begin(first).ok());
  REQUIRE(table.publish(first).ok());
  SECTION("prepared: the retry gets it to close, and is the one found from then on") {
    auto retry = attempt("s", 5);
    auto taken = table.begin(retry, {3});
    REQUIRE(taken.ok());
    CHECK(*taken == first);
    REQUIRE(table.publish(retry).ok());
    CHECK(table.find("s") == retry);
    CHECK(table.find("s", 3) == nullptr);
    // A third attempt that supersedes only the first is not the retry's: refused as before.
    CHECK(table.begin(attempt("s", 7), {3}).status().code() == absl::StatusCode::kAlreadyExists);
    // ... and one that supersedes both takes the retry over in turn.
    auto third = table.begin(attempt("s", 7), {3, 5});
    REQUIRE(third.ok());
    CHECK(*third == retry);
  }
  SECTION("another Sync call reusing the id does not supersede it") {
    CHECK(table.begin(attempt("s", 5)).status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(table.begin(attempt("s", 5), {4}).status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(table.find("s") == first);
  }
  SECTION("a retry that was itself given up already is refused, and leaves the earlier attempt open") {
    CHECK(table.takeForClose("s", 5) == nullptr);  // its Finish came first
    CHECK(table.begin(attempt("s", 5), {3}).status().code() == absl::StatusCode::kAborted);
    CHECK(table.find("s") == first);
  }
}

TEST_CASE("attempt table: a retry waits for an earlier attempt still being prepared, which then ends refused",
          "[daemon][attempt]") {
  using std::chrono::milliseconds;
  AttemptTable table("n0");
  auto first = attempt("s", 3);
  REQUIRE(table.begin(first).ok());  // preparing
  SECTION("its Prepare ends while the retry waits") {
    std::thread preparer([&] {
      // Its Prepare goes on until the retry has given it up (seen through a stand-in of the same
      // attempt, which the table does not hold), then ends refused.
      for (auto probe = attempt("s", 3); table.publish(probe).ok(); probe = attempt("s", 3))
        std::this_thread::sleep_for(milliseconds(1));
      CHECK(table.publish(first).code() == absl::StatusCode::kAborted);
      table.abandon(first);
    });
    auto taken = table.begin(attempt("s", 5), {3}, std::chrono::seconds(30));
    preparer.join();
    REQUIRE(taken.ok());
    CHECK(*taken == nullptr);  // nothing left to close: it never opened
    CHECK(first->phase() == Phase::kClosed);
  }
  SECTION("its Prepare outlasts the wait: the retry is refused, the earlier one still ends refused") {
    auto taken = table.begin(attempt("s", 5), {3}, milliseconds(20));
    CHECK(taken.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK_THAT(std::string(taken.status().message()), Catch::Contains("still being prepared"));
    CHECK(table.publish(first).code() == absl::StatusCode::kAborted);
  }
}

TEST_CASE("attempt table: an attempt given up before it was prepared is refused", "[daemon][attempt]") {
  AttemptTable table("n0");
  SECTION("its Prepare arrives after the Finish") {
    CHECK(table.takeForClose("s", 7) == nullptr);
    CHECK(table.begin(attempt("s", 7)).status().code() == absl::StatusCode::kAborted);
    CHECK(table.begin(attempt("s", 8)).ok());  // another attempt of the sync is not
  }
  SECTION("the Finish arrives while it is being prepared") {
    auto a = attempt("s", 7);
    REQUIRE(table.begin(a).ok());
    CHECK(table.takeForClose("s", 7) == nullptr);  // preparing: nothing to close yet
    CHECK(table.publish(a).code() == absl::StatusCode::kAborted);
    table.abandon(a);
    CHECK(a->phase() == Phase::kClosed);
    CHECK(table.begin(attempt("s", 9)).ok());
  }
}

TEST_CASE("attempt table: a Finish repeated for an attempt a Finish took gets the first one's answer",
          "[daemon][attempt]") {
  using std::chrono::milliseconds;
  AttemptTable table("n0");
  auto a = attempt("s", 7);
  REQUIRE(table.begin(a).ok());
  REQUIRE(table.publish(a).ok());
  CHECK_FALSE(table.closedBefore("s", 7, true, milliseconds(0)).has_value());  // not taken yet
  REQUIRE(table.takeForClose("s", 7, /*commit=*/true) == a);
  CHECK(table.takeForClose("s", 7, true) == nullptr);
  // Its close still runs: the repeat waits for it, then says so.
  auto pending = table.closedBefore("s", 7, true, milliseconds(20));
  REQUIRE(pending.has_value());
  CHECK(pending->status().code() == absl::StatusCode::kUnavailable);
  // Another attempt of the sync, or another sync: nothing was taken for it.
  CHECK_FALSE(table.closedBefore("s", 8, true, milliseconds(0)).has_value());
  CHECK_FALSE(table.closedBefore("t", 7, true, milliseconds(0)).has_value());

  shardcast::v1::FinishResponse committed;
  committed.add_ranks()->set_rank(3);
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(50));
    table.closed("s", 7, committed);
  });
  auto repeat = table.closedBefore("s", 7, true, std::chrono::seconds(30));  // waits for the close
  closer.join();
  REQUIRE(repeat.has_value());
  REQUIRE(repeat->ok());
  REQUIRE((*repeat)->ranks_size() == 1);
  CHECK((*repeat)->ranks(0).rank() == 3);
  // The attempt is not prepared again (a repeated commit would take it), another one of the sync is.
  CHECK(table.begin(attempt("s", 7)).status().code() == absl::StatusCode::kAborted);
  CHECK(table.begin(attempt("s", 8)).ok());
  // An abort after the commit is not taken for it.
  auto abort = table.closedBefore("s", 7, false, milliseconds(0));
  REQUIRE(abort.has_value());
  CHECK(abort->status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(abort->status().message()), Catch::Contains("was committed on node \"n0\" already"));

  // A close that failed answers its repeat with the same failure.
  auto b = attempt("u", 9);
  REQUIRE(table.begin(b).ok());
  REQUIRE(table.publish(b).ok());
  REQUIRE(table.takeForClose("u", 9, true) == b);
  table.closed("u", 9, absl::FailedPreconditionError("commit refused on node \"n0\": rank 1 was replaced"));
  auto failed = table.closedBefore("u", 9, true, milliseconds(0));
  REQUIRE(failed.has_value());
  CHECK(failed->status().message() == "commit refused on node \"n0\": rank 1 was replaced");
  // Taken without a Finish's word (the reaper's, shutdown's): not remembered.
  auto c = attempt("v", 11);
  REQUIRE(table.begin(c).ok());
  REQUIRE(table.publish(c).ok());
  REQUIRE(table.takeForClose("v", 11) == c);
  CHECK_FALSE(table.closedBefore("v", 11, true, milliseconds(0)).has_value());
}

TEST_CASE("attempt table: expired leases and shutdown take only prepared attempts, drained ones leave",
          "[daemon][attempt]") {
  AttemptTable table("n0");
  auto live = attempt("live", 1);
  auto silent = attempt("silent", 2);
  auto preparing = attempt("preparing", 3);
  live->lease = std::chrono::milliseconds(60000);
  silent->lease = std::chrono::milliseconds(1);
  for (auto& a : {live, silent, preparing}) REQUIRE(table.begin(a).ok());
  REQUIRE(table.publish(live).ok());
  REQUIRE(table.publish(silent).ok());
  const auto later = SyncAttempt::Clock::now() + std::chrono::seconds(1);
  const auto expired = table.takeExpired(later);
  REQUIRE(expired.size() == 1);
  CHECK(expired[0] == silent);
  const auto all = table.takeAll();
  REQUIRE(all.size() == 1);
  CHECK(all[0] == live);

  live->beginClose(End::kDirty, "n0", "shutdown");
  live->drain(true);
  CHECK(live->drainsReading());
  table.addDraining(live);
  bool done = false;
  CHECK(table.takeDrained([&](const SyncAttempt&) { return done; }).empty());
  done = true;
  CHECK(table.takeDrained([&](const SyncAttempt&) { return done; }).size() == 1);
}

TEST_CASE("outbox: a window bounds the bytes in flight per node, batches start together", "[daemon][attempt]") {
  Outbox box;
  const auto write = [](uint64_t bytes) {
    Outbox::Write w;
    w.op.length = bytes;
    return w;
  };
  for (int i = 0; i < 5; ++i) box.queue(1, nullptr, write(4));
  box.queue(2, nullptr, write(4));
  CHECK(box.pending() == 12);  // each write and its notification
  std::shared_ptr<shardcast::transport::Endpoint> ep;
  const Outbox::Limits limits{10, 8, 100};
  CHECK(box.take(1, limits, &ep).size() == 2);  // a batch of 8 bytes
  CHECK(box.take(1, limits, &ep).empty());      // 8 in flight: another batch would overflow 10
  CHECK(box.take(2, limits, &ep).size() == 1);  // each node its own window
  box.completed(1, 8, 4);
  CHECK(box.take(1, limits, &ep).size() == 2);
  box.completed(1, 8, 4);
  box.dropQueued();  // the fifth write of node 1 never starts
  CHECK(box.pending() == 2);
  box.completed(2, 4, 2);
  CHECK(box.pending() == 0);
}

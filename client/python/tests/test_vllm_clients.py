"""shardcast.vllm.clients.ReplicaClients without vLLM: servers stand in as objects of the weight-sync
protocol that record their calls, or raise. A server whose update fails is left out of that
update and named while the others finish it; the call raises only when every server failed."""

from __future__ import annotations

import threading

import pytest

from shardcast.vllm.clients import ReplicaClients, replica_group


class Server:
    """vLLM's session rules: start opens one, an update that fails on the server ends it, finish
    needs one open. `fail`: the call that fails on the server; "lost-update": the update goes
    through on the server but its reply is lost (the call raises here)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list = []
        self.fail = fail
        self.session = False
        self.lock = threading.Lock()

    def _record(self, what: str, arg=None) -> None:
        with self.lock:
            self.calls.append((what, arg))
        if what == self.fail:
            self.session = False
            raise RuntimeError(f"{what} failed here")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._record("init", init_info)

    def start_weight_update(self) -> None:
        self._record("start")
        self.session = True

    def update_weights(self, update_info: dict) -> None:
        self._record("update", update_info)
        if self.fail == "lost-update":
            raise TimeoutError("the reply was lost")

    def finish_weight_update(self, weight_version=None) -> None:
        if not self.session:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self._record("finish", weight_version)
        self.session = False


def update(clients: ReplicaClients, version: int) -> None:
    clients.start_weight_update()
    clients.update_weights({"version": version})
    clients.finish_weight_update(str(version))


def test_each_server_is_told_its_replica_id_and_one_added_later_gets_the_next():
    servers = [Server(), Server()]
    clients = ReplicaClients(servers)
    clients.init_weight_transfer_engine({"group": "vllm", "checkpoint": {"w": [[2], "float32"]}})
    assert [s.calls[0][1]["replica"] for s in servers] == [0, 1]
    assert all(s.calls[0][1]["group"] == "vllm" for s in servers)
    late = Server()
    assert clients.add(late) == 2
    assert late.calls == [("init", {"group": "vllm", "checkpoint": {"w": [[2], "float32"]}, "replica": 2})]
    assert replica_group("vllm", 2) == "vllm.r2"
    update(clients, 1)
    assert clients.updated == [0, 1, 2] and clients.failed == {}
    for s in servers + [late]:
        assert [c[0] for c in s.calls[1:]] == ["start", "update", "finish"]


def test_a_server_whose_update_fails_is_named_and_the_others_finish():
    servers = [Server(), Server(fail="update"), Server()]
    clients = ReplicaClients(servers)
    clients.init_weight_transfer_engine({"group": "vllm"})
    update(clients, 3)
    assert clients.updated == [0, 2]
    assert list(clients.failed) == [1] and "update failed here" in clients.failed[1]
    assert ("finish", "3") not in servers[1].calls  # its session ended with its update: nothing applied
    assert ("finish", "3") in servers[0].calls and ("finish", "3") in servers[2].calls
    # The next update starts afresh: every server is asked again.
    servers[1].fail = ""
    update(clients, 4)
    assert clients.updated == [0, 1, 2] and clients.failed == {}


def test_a_server_that_cannot_start_is_left_out_and_every_server_failing_raises_naming_them():
    clients = ReplicaClients([Server(fail="start"), Server()])
    clients.init_weight_transfer_engine({"group": "vllm"})
    update(clients, 1)
    assert clients.updated == [1] and list(clients.failed) == [0]
    everyone = ReplicaClients([Server(fail="update"), Server(fail="update")])
    everyone.init_weight_transfer_engine({"group": "vllm"})
    everyone.start_weight_update()
    with pytest.raises(RuntimeError) as failed:
        everyone.update_weights({"version": 1})
    assert "every replica" in str(failed.value) and "replica 0" in str(failed.value) and "replica 1" in str(failed.value)


def test_an_init_that_fails_anywhere_raises_naming_the_replica():
    clients = ReplicaClients([Server(), Server(fail="init")])
    with pytest.raises(RuntimeError) as failed:
        clients.init_weight_transfer_engine({"group": "vllm"})
    assert "replica 1" in str(failed.value) and "init failed here" in str(failed.value)


def test_a_server_whose_update_reply_was_lost_is_finished_and_counted():
    servers = [Server(), Server(fail="lost-update")]
    clients = ReplicaClients(servers)
    clients.init_weight_transfer_engine({"group": "vllm"})
    update(clients, 2)
    assert clients.updated == [0, 1] and clients.failed == {}
    assert ("finish", "2") in servers[1].calls and not servers[1].session
    servers[1].fail = ""
    update(clients, 3)  # its session ended: the next update starts as usual
    assert clients.updated == [0, 1]

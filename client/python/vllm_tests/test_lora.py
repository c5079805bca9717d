"""LoRA adapters as versions against a real vLLM (CPU): a two-rank FSDP2 trainer trains two PEFT
adapters and syncs them with the shardcast trainer engine (`lora=True`) into vLLM started with
enable_lora at TP=2 (run_lora.py); one adapter goes into two offline vLLMs as a replica set
(run_lora_replicas.py) and into `vllm serve` with two data-parallel engines, named in its OpenAI
routes (serve_adapters.py, on the server whose full weights test_recovery.py updates).
Adapters vLLM cannot serve are refused at init, naming the adapter, with nothing left registered.
After every step, what vLLM serves with each adapter must be exactly what a vLLM started fresh
serves with that adapter loaded from disk as PEFT saved it (greedy tokens and logprobs, bit for
bit); an adapter a step does not carry keeps serving its version; the base model is never
touched; while a step's bytes land, vLLM serves the previous version whole; a daemon killed
mid-update leaves the previous adapters serving."""

from __future__ import annotations

from conftest import IN_PROCESS, run_script


def test_fsdp2_peft_adapters_into_vllm_tp2_every_step_as_loaded_from_disk(models, fresh, tmp_path):
    # TP=2 only: TP=1 adds nothing the engine does differently (every rank receives each adapter
    # whole and vLLM's set_lora cuts it), and the replica-set test below runs TP=1 against a fresh
    # vLLM all the same.
    tp = 2
    out = run_script("run_lora.py", models["llama"], str(tp), str(tmp_path), timeout=900, tp=tp)
    assert out.get("error") is None, out.get("error")
    # Adapters vLLM does not take are refused at trainer_init, on both ranks, each named, and leave
    # nothing registered.
    refused = out["refused"]
    assert "LoRA rank 32 is greater than max_lora_rank 16" in refused["rank 32"]["error"], refused
    assert "DoRA" in refused["dora"]["error"], refused
    for what in refused.values():
        assert "vLLM refuses LoRA adapter 'policy'" in what["error"], what
        assert what["groups"] == {"n0": [], "n1": []}, what
    assert out["ids"] == {"policy": 100001, "critic": 100002}
    # An adapter vLLM dropped is built again from the version in service when a request names it.
    assert out["after_drop_matches"]
    steps = out["steps"]
    assert [s["carried"] for s in steps] == [["policy", "critic"], ["policy"], ["critic"]]
    dirs = [s["dirs"][name] for s in steps for name in s["carried"]]
    loaded = fresh.served_lora(tp, models["llama"], *dirs)
    reference = iter(loaded["served"])
    previous = None
    for n, step in enumerate(steps, start=1):
        for name in ("policy", "critic"):
            if name in step["carried"]:
                assert step["served"][name] == next(reference), \
                    f"step {n}: vLLM serves adapter {name!r} otherwise than a fresh vLLM loading it from disk"
                if previous is not None:  # training moved it
                    assert step["served"][name] != previous[name], f"step {n}: adapter {name!r} did not change"
                    # While the step's bytes landed, vLLM served the previous version, whole.
                    assert step["during_matches_previous"][name], f"step {n}: adapter {name!r} changed mid-update"
            else:
                assert step["served"][name] == previous[name], f"step {n}: adapter {name!r} changed, not carried"
        # The base model: no update touches it, and it is not an adapter's.
        assert step["base"] == out["base"] == loaded["base"], f"step {n}: the base model changed"
        assert step["served"]["policy"] != out["base"] and step["served"]["critic"] != out["base"]
        assert all(step["wire_bytes"][name] > 0 for name in step["carried"])
        previous = step["served"]
    # Step 4: vLLM's daemon killed mid-update; the update fails, naming the adapter's group, and
    # vLLM serves step 3's adapters.
    assert "vllm.lora." in out["killed"], out["killed"]
    assert out["served_after_kill"] == steps[-1]["served"]


def test_an_adapter_into_vllm_servers_as_a_replica_set_one_joining_one_cut(models, fresh, tmp_path):
    # Two offline vLLMs (TP=1) on daemons n1 and n2 through ReplicaClients: the adapter "policy" is
    # the set "vllm.lora.policy", replica k its group ".r<k>"; the trainer (plain tensors) on n0.
    out = run_script("run_lora_replicas.py", models["llama"], str(tmp_path), env_extra=IN_PROCESS, timeout=600)
    loaded = fresh.served_lora(1, models["llama"], out["dir_1"], out["dir_2"], out["dir_3"])["served"]
    assert out["replicas_1"] == {"vllm.lora.policy.r0": ""}
    # Replica 1 joined after step 1 and its adapter caught up from replica 0: the trainer sent nothing.
    assert out["joined_as"] == 1
    assert out["caught_up"] == {"vllm.lora.policy.r1": "vllm.lora.policy.r0"}
    assert out["trainer_sent_for_catch_up"] == 0
    assert out["served_1"] == [loaded[0], loaded[0]]
    # Step 2: replica 1's node frozen past the deadline: cut from the sync and named, then caught up
    # inside the update; both serve step 2, as a fresh vLLM loading it from disk does.
    assert out["replicas_2"]["vllm.lora.policy.r0"] == "", out["replicas_2"]
    assert '"n2"' in out["replicas_2"]["vllm.lora.policy.r1"], out["replicas_2"]
    assert out["updated_2"] == [0, 1] and out["failed_2"] == {}
    assert out["served_2"] == [loaded[1], loaded[1]]
    assert loaded[0] != loaded[1]
    # After both sides shut their engines down, a new trainer engine takes the same adapter again.
    assert out["replicas_3"] == {"vllm.lora.policy.r0": "", "vllm.lora.policy.r1": ""}
    assert out["nodes_3"] == [["vllm.lora.policy.r0", "n1"], ["vllm.lora.policy.r1", "n2"]], out["nodes_3"]
    assert out["served_3"] == [loaded[2], loaded[2]]


def test_an_adapter_into_vllm_serve_with_two_data_parallel_engines_is_named_once_a_version_serves(models, fresh,
                                                                                                  run_dp):
    # `vllm serve --enable-lora --data-parallel-size 2 --api-server-count 1` (TP=1 each,
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), the server test_recovery.py's data-parallel cases
    # updated to step 4 with full weights (`run_dp`, conftest.py), taken over by a trainer of an
    # adapter over HTTP: each engine one replica of the adapter's set; requests name the adapter as
    # model "policy", and each step is asked of both engines (serve_adapters.py).
    out = run_dp["lora"]
    assert out.get("error") is None, out.get("error")
    loaded = fresh.served_lora(1, run_dp["dir_4"], out["dir_1"], out["dir_2"], out["dir_3"])
    model = models["llama_tied"]  # the name the server serves its base model under
    # The adapters apply to the base the full-weight steps left: step 4's weights.
    assert out["base_0"] == run_dp["served_4"]
    # No name before a version serves: a request naming it is refused, and the server serves on.
    assert out["models_0"] == [model] and out["policy_status_0"] == 404
    # Each step serves, under the name, exactly what a fresh vLLM serves with the step's adapter
    # loaded from disk; the base model is untouched.
    for step in (1, 2, 3):
        assert out[f"models_{step}"] == sorted([model, "policy"])
        assert out[f"served_{step}"] == [loaded["served"][step - 1]] * 2, f"step {step}: not the adapter saved"
        assert out[f"base_{step}"] == out["base_0"] == loaded["base"]
    assert loaded["served"][0] != loaded["served"][1] != loaded["served"][2] != out["base_0"]
    # The server loaded the name under an id of its own, which the worker put back after step 2's
    # update (and no copy under the trainer's id).
    loads = out["server_log_loads"]
    assert len(loads) == 2 and all("name 'policy', path 'shardcast://vllm.lora.policy'" in x for x in loads), loads
    assert len(out["lora_ids_2"]) == 1 and out["lora_ids_2"][0] < 100000 and out["lora_ids_2"][0] in out["lora_ids_1"]
    # The server's weight transfer shut down while the name was still given: the workers dropped
    # the adapter, and a request naming it got step 2's version, not an engine that dies.
    assert out["lora_ids_shut"] == [] and out["models_shut"] == sorted([model, "policy"])
    assert out["served_shut"] == out["served_2"]  # on both engines
    # The trainer engine shut down: the name is taken back (a request naming it is refused); the
    # base serves on. A new trainer engine names it again only once its first version serves.
    assert out["models_after"] == [model] and out["policy_status_after"] == 404
    assert out["base_after"] == out["base_0"]
    assert out["models_reinit"] == [model]

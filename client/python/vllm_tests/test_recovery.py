"""`vllm serve` at TP=2 through everything that goes wrong in an RL loop (run_recovery.py): checkpoints
that do not fit vLLM's loaders are refused by name, leaving nothing registered; no KV computed with
old weights is served after an update; a failed update, a refused trainer_init and a daemon killed
mid-update are each followed by an update that goes through. One server serves every case (it
takes a minute to start at TP=2); each test checks one of them. The same again, fewer refusals,
with two data-parallel engines as replicas serving a model of tied embeddings and a padded
vocabulary (`run_dp`, conftest.py: the server test_lora.py's `vllm serve` case then takes over
with an adapter), each step then served exactly as a vLLM started fresh from its weights."""

from __future__ import annotations

import pytest

from conftest import DP, run_script

TP = 2
EMPTY = {"n0": {}, "n1": {}}


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("recovery")
    return run_script("run_recovery.py", models["llama"], str(TP), str(out), tp=TP, timeout=900)


def refused(run, what: str) -> str:
    case = run["refused"][what]
    # Nothing registered anywhere: neither the trainer's group on n0 nor any worker's on n1.
    assert {"n0": case["n0"], "n1": case["n1"]} == EMPTY, case
    assert case["error"], f"{what}: trainer_init went through"
    return case["error"]


def test_a_tensor_larger_than_vllms_is_refused_naming_it_and_the_parameter(run):
    error = refused(run, "longer")
    assert ("checkpoint tensor 'model.layers.0.self_attn.q_proj.weight' (shape [300, 256]): its elements "
            "[256:300, 0:256] land in no parameter of vLLM's model") in error, error
    assert "'model.layers.0.self_attn.qkv_proj.weight' takes [0:128, 0:256] (rank 0)" in error, error
    assert "'model.layers.0.self_attn.qkv_proj.weight' takes [128:256, 0:256] (rank 1)" in error, error


def test_a_tensor_smaller_than_vllms_is_refused_naming_it_and_the_parameter(run):
    error = refused(run, "shorter")
    # Rank 1's rows of k are not in a 64-row tensor: refused there, and raised on every worker.
    assert ("failed on worker(s) 1: ProbeError: checkpoint tensor 'model.layers.0.self_attn.k_proj.weight' "
            "(shape [64, 256]) does not fit vLLM's parameter 'model.layers.0.self_attn.qkv_proj.weight' (shape "
            "[256, 256] on this rank)") in error, error
    assert "workers 0, 1:" in error, error


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it_and_the_parameter(run):
    error = refused(run, "transposed")
    assert ("checkpoint tensor 'model.layers.0.mlp.gate_proj.weight' (shape [256, 512]) does not fit vLLM's "
            "parameter 'model.layers.0.mlp.gate_up_proj.weight'") in error, error


def test_a_dtype_no_sync_converts_to_vllms_is_refused(run):
    error = refused(run, "float16")
    assert ("checkpoint tensor 'model.norm.weight' is float16 in the trainer, vLLM's parameter 'model.norm.weight' "
            "holds float32") in error, error


def test_a_name_vllm_does_not_have_is_refused_naming_it(run):
    error = refused(run, "unknown name")
    assert ("checkpoint tensor 'model.final_norm.weight' (shape [256]): no parameter of vLLM's LlamaForCausalLM "
            "takes it") in error, error


def test_a_parameter_no_announced_tensor_reaches_is_refused_naming_it(run):
    error = refused(run, "left out")
    assert "vLLM's parameter(s) 'model.norm.weight': no announced checkpoint tensor lands in them" in error, error


def test_after_a_refusal_a_trainer_init_that_fits_registers_every_rank(run):
    assert run["registered"] == {"n0": {"trainer": 1}, "n1": {"vllm": TP}}


@pytest.mark.parametrize("step", [1, 2, 4])
def test_no_kv_of_the_old_weights_is_served_after_an_update(run, step):
    # The prompts were served before the update (their shared first KV block cached); after it,
    # vLLM serves exactly what it serves with its prefix cache emptied by hand.
    assert run[f"served_{step}"] == run[f"recomputed_{step}"]
    assert all(check["wrong"] == [] for check in run[f"checks_{step}"]) and len(run[f"checks_{step}"]) == TP


def test_every_element_a_sync_writes_is_written_by_exactly_one_tensor(run):
    checks = run["checks_1"]
    for check in checks:
        for param, (numel, written, padding) in check["coverage"].items():
            assert written + padding == numel and written > 0, (param, numel, written, padding)
    # The daemon's plan writes every registered byte (each worker's boxes) once.
    assert run["plan_bytes_needed"] == sum(check["registered_bytes"] for check in checks)


def test_double_buffered_vllm_serves_its_old_weights_until_the_update_finishes(run):
    assert run["served_landed"] == run["served_0"]
    assert run["served_1"] != run["served_0"]


def test_a_failed_update_names_every_worker_and_the_next_goes_through(run):
    missing = run["missing_version"]
    assert missing["status"] >= 400 and "(2 of 2 worker(s))" in missing["reply"], missing
    assert "did not receive version 99" in missing["reply"], missing
    assert run["served_after_missing"] == run["served_1"]
    assert run["served_2"] != run["served_1"]


def test_a_daemon_killed_mid_update_names_the_ranks_and_the_update_after_its_restart_goes_through(run):
    killed = run["killed"]
    assert "version 3 did not reach 'vllm'" in killed, killed
    assert 'group "vllm" on node "n1"' in killed, killed
    # Double-buffered: vLLM serves step 2 as before.
    assert run["served_after_kill"] == run["served_2"]
    assert run["served_4"] != run["served_2"]
    assert run["weight_version"] == "4"


# ---- the same with data-parallel engines: `vllm serve --data-parallel-size 2` (TP=1 each), each
# engine one replica of the set "vllm", requests landing on either; the model has tied embeddings,
# one KV head and a vocabulary of 500 that vLLM pads to 512 ----

DP_GROUPS = {f"vllm.r{r}": 1 for r in range(DP)}
BOTH_COMMITTED = {group: "" for group in DP_GROUPS}


def test_data_parallel_a_refused_trainer_init_leaves_nothing_registered_and_the_next_registers_every_engine(run_dp):
    error = refused(run_dp, "longer")
    assert "checkpoint tensor 'model.layers.0.self_attn.q_proj.weight' (shape [300, 256])" in error, error
    error = refused(run_dp, "unknown name")
    assert "checkpoint tensor 'model.final_norm.weight' (shape [256]): no parameter" in error, error
    assert run_dp["registered"] == {"n0": {"trainer": 1}, "n1": DP_GROUPS}


@pytest.mark.parametrize("step", [1, 2, 4])
def test_data_parallel_every_engine_takes_every_update_and_serves_no_kv_of_the_old_weights(run_dp, step):
    assert run_dp[f"replicas_{step}"] == BOTH_COMMITTED, run_dp[f"replicas_{step}"]
    assert run_dp[f"served_{step}"] == run_dp[f"recomputed_{step}"]
    checks = run_dp[f"checks_{step}"]
    assert checks and all(check["wrong"] == [] for check in checks), checks


def test_data_parallel_every_step_serves_exactly_what_a_fresh_vllm_serves_from_its_weights(run_dp, fresh):
    steps = (1, 2, 4)
    for step, reference in zip(steps, fresh.served(1, *[run_dp[f"dir_{step}"] for step in steps])):
        assert run_dp[f"served_{step}"] == reference, f"step {step}: vLLM serves other tokens or logprobs than a fresh vLLM"
    assert run_dp["versions_4"] == {group: [4] for group in DP_GROUPS}, run_dp["versions_4"]
    # Tied: the embedding (which lm_head reads) lands in place; linear weights are prepacked. The
    # server runs with --enable-lora: both sit in vLLM's LoRA wrappers (`base_layer`).
    for check in run_dp["checks_4"]:
        assert "model.embed_tokens.base_layer.weight" in check["direct"], check
        assert "model.layers.0.self_attn.qkv_proj.base_layer.weight" in check["processed"], check


def test_data_parallel_a_failed_update_and_a_daemon_killed_mid_update_are_each_followed_by_one_that_goes_through(
        run_dp):
    missing = run_dp["missing_version"]
    assert missing["status"] >= 400 and "version 99" in missing["reply"], missing
    assert run_dp["served_after_missing"] == run_dp["served_1"]
    assert run_dp["served_2"] != run_dp["served_1"]
    assert run_dp["killed"], "send_weights returned while the daemon of both replicas was frozen, then killed"
    assert run_dp["served_after_kill"] == run_dp["served_2"]
    assert run_dp["served_4"] != run_dp["served_2"]
    assert run_dp["weight_version"] == "4"

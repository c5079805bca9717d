"""vLLM's general-plugin entry point (`vllm.general_plugins`: shardcast): registers the `shardcast`
weight-transfer backend, in both registries (workers, trainers), in every vLLM process (engine
core, each worker), so that `LLM(..., weight_transfer_config={"backend": "shardcast"})` finds it,
and has the engine core run its update calls through shardcast.vllm.session (a status from every
worker, the prefix cache reset when an update finishes). Registering twice is harmless (vLLM may
load plugins more than once per process)."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, name in ((WeightTransferEngineFactory, "shardcast.vllm.engine", "ShardcastWeightTransferEngine"),
                                  (WeightTransferTrainerFactory, "shardcast.vllm.trainer", "ShardcastTrainerEngine")):
        try:
            factory.register_engine("shardcast", module, name)
        except ValueError:  # registered already in this process
            pass
    from shardcast.vllm import session

    if not session.install():
        import logging

        logging.getLogger("vllm.shardcast").warning(
            "shardcast: this vLLM has no EngineCore.collective_rpc (vLLM 0.32's) to run updates through: a failed "
            "update can leave later ones out of step at TP >= 2, and updates do not reset the prefix cache")

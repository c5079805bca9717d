"""vLLM's general-plugin entry point (`vllm.general_plugins`: shardcast): registers the `shardcast`
weight-transfer backend in every vLLM process (engine core, each worker), so that
`LLM(..., weight_transfer_config={"backend": "shardcast"})` finds it. Registering twice is
harmless (vLLM may load plugins more than once per process)."""


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine("shardcast", "shardcast.vllm.engine",
                                                    "ShardcastWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass

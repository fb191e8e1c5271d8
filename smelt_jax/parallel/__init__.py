"""Running the train step over a device mesh: placement of the train state (`train_state`), expert
parallelism (`expert_parallel`), multi-host start-up (`distributed`) and ahead-of-time TPU compile
reports (`compile_report`). The logical-axis rules live in `smelt_jax.sharding`, nowhere else."""

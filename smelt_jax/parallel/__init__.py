"""Running the train step over a device mesh: multi-host start-up (`distributed`), layout parsing
(`layout`), and the logical axis names with the one table that maps them to mesh axes (`sharding`,
nowhere else). Placement of the train state lives in `smelt_jax.train.state`. Expert parallelism is a
strategy of the one MoE layer (`smelt_jax.model.expert_exchange`). Ahead-of-time TPU compile reports
live in `smelt_jax.compile`."""

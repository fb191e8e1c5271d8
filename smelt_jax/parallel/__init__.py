"""Running the train step over a device mesh: multi-host start-up (`distributed`) and layout parsing
(`layout`). Placement of the train state lives in `smelt_jax.train.state`. Expert parallelism is a
strategy of the one MoE layer (`smelt_jax.model.expert_exchange`).
Ahead-of-time TPU compile reports live in `smelt_jax.compile`. The logical-axis rules live in
`smelt_jax.sharding`, nowhere else."""

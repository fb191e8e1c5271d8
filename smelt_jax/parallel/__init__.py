"""Running the train step over a device mesh: placement of the train state (`train_state`), multi-host
start-up (`distributed`) and layout parsing (`layout`). Expert parallelism is a strategy of the one MoE
layer (`smelt_jax.model.expert_exchange`).
Ahead-of-time TPU compile reports live in `smelt_jax.compile`. The logical-axis rules live in
`smelt_jax.sharding`, nowhere else."""

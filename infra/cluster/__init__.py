"""Ray and the placement of a run's roles.

- `ray_connect`: join a Ray cluster (`RAY_ADDRESS`) or start a local one on loopback (`connect_ray`).
- `placement`: `Placement`, the driver's owner of Ray and of each role's actor group.
- `cluster`: `Cluster`, which places, sets up and drives the trainer ranks and rollout engines.
- `roles`: the driver-side rollout role (tokenizer, datasets, prompt sampler; no model weights)."""

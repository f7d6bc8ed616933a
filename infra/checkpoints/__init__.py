"""Checkpoints: written, verified, mirrored to S3, resumed and exported.

- `store`: `CheckpointStore`, atomic checkpoint directories on disk with an S3 mirror (the layout is in its
  docstring); `format`: run state <-> safetensors + JSON, checksums and the manifest; `shards`: the trainer ranks'
  tensors through torch.distributed.checkpoint; `remote` and `remote_files`: the S3 side; `s3`: the boto3 client.
- `lease`: one writer per S3 run prefix; `resume`: run directories, `rl.resume` and the run lock.
- `export`: a checkpoint as a transformers directory (`posttrain export`)."""

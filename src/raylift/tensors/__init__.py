"""Layer 2, tensors and the files that hold them: ranged reads, streaming safetensors
writes, pretrained weights and the driver's checks of them, the meta-device build and
its materialising, precision, the optimizer, adapters, metrics, and the checkpoint
format (listing, checksums, the reader). Needs no engine and no Ray."""

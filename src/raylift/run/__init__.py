"""Layer 6, the run: connecting to Ray, the trainer's assembly, each worker and its
loop, worker-side checkpointing and faults, the memory plan and the pre-flight check."""

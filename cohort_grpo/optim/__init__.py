"""The optimizer and the dtypes it keeps: the precision plan of weights, gradients and optimizer state
(`precision`), AdamW with fp32 master weights for bf16 parameters (`bf16`), and AdamW over FSDP2's shards
(`sharded_adamw`)."""

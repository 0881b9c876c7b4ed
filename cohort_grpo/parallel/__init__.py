"""Where the ranks and the weights go: the run's `Placement` (which ranks train, which sample, in which
tensor-parallel groups, on which copy of the weights, what is released between phases: `placement`), the
collectives and model wrapping under torchrun (`distributed`), FSDP2's sharded copy (`sharding`), training ranks
that sample over their tensor-parallel shards (`colocation`), ranks of their own that only sample
(`disaggregation`), and the report of a rank that failed (`faults`)."""

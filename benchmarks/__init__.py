"""The jshard benchmark harness: `python -m benchmarks [--quick] [--out PATH]`.

On 8 simulated CPU devices it measures, each figure in the same run as what it is compared with:

1. per reference model, the collective bytes per step and per-device memory of the compiled program
   under jshard's propagated plan, Shardy's from the same anchors, and the expert plans written by
   hand with PartitionSpecs (data, FSDP, Megatron, 2-D); jshard's predicted bytes against the
   compiled ones; every plan's loss against one device's; and planning alone on 64 and 512 devices;
2. planning time against graph size (the GPT train step, unrolled and scanned);
3. trace + plan + compile time against plain `jax.jit` of the same shardings;
4. step time of the jshard program against the same shardings jitted by hand.

It prints the tables and writes them, with the machine they ran on, to `BENCHMARKS.md`.
"""

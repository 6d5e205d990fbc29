"""Tensor parallelism (`--tp-size`): one worker process per device, rank 0 in the server process."""

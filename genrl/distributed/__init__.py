"""Processes and devices: the Accelerate/DeepSpeed set-up, ZeRO-3 partitioned init, pre-emption."""

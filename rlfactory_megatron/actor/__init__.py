"""Actor, critic and reference models on Megatron-Core, and the batch record they train on."""

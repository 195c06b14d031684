"""Process start-up: launcher environments, process groups, megatron parallel state, CPU adaptation."""

"""The pieces of RL on a quantized model that the methods grpo / dapo (train/methods/grpo.py) put on the
one loop: tasks and rewards, sampling, the policy losses, the supervised warm-up, the policy module."""

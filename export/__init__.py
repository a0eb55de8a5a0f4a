"""PyTorch definitions of the Qwen3 target and the DFlash drafter, checkpoint loading, and the
eager reference decoder. The same modules are the export source. Needs the `compile` extra (torch).
"""

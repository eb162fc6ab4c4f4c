"""The iterative engine: the latents' loop and its update rules (``iterate``), the watch on
gradient steps (``divergence``) and the contract of an inference scheme the compiled reader
iterates (``scheme``)."""

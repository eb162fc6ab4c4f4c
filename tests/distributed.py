"""Shared by the tests that start a process group (tests/test_module_contract.py,
tests/iterative/test_engine.py)."""


def release_process_group():
    """Destroy the default process group once nothing else holds it. A DDP reducer that
    outlives ``destroy_process_group`` frees the gloo group in its own destructor, holding the
    GIL while joining gloo's threads, one of which may wait for the GIL: a deadlock (seen
    about once in a dozen runs with torch 2.13). So: drop the reducer first, then the group."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()

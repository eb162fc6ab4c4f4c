"""DistributedDataParallel across real processes: two gloo ranks, each with half the batch,
all-reduce exactly the full-batch gradient of a compiled layer (single-shot and iterative);
``gallery/train_ddp.py`` trains under ``torchrun`` and as a single process.

The gradient test starts its ranks with ``torch.multiprocessing`` (spawn) and a ``file://``
rendezvous in ``tmp_path`` (no port to collide with concurrent runs); each rank saves its
averaged gradients with ``torch.save`` and the test process compares them with the gradient
it computes itself on the whole batch.
"""

import json
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

import structattn as sa

f64 = torch.float64
ROOT = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ROOT / "gallery" / "train_ddp.py"
WORLD = 2
BATCH = 6  # three examples per rank
TIMEOUT = 180  # seconds: generous, a loaded 2-core machine starts Python slowly


def _make(name):
    """A compiled float64 layer and its inputs' shapes (batch first)."""
    if name == "self_attention":
        m = sa.models.self_attention(8, heads=2, causal=True, dtype=f64)
        shapes = [(BATCH, 5, 8)]
    elif name == "hopfield":  # latent state ξ, 3 CCCP updates back-propagated through
        m = sa.models.hopfield(8, 6, heads=2, iteration=sa.IterationOptions(steps=3), dtype=f64)
        shapes = [(BATCH, 3, 8), (BATCH, 7, 6)]
    elif name == "slot_attention":  # EM on the slots from explicit initial slots (no RNG draw)
        m = sa.models.slot_attention(3, 8, iters=3, recipe="collapsed", temperature=0.5, dtype=f64)
        shapes = [(BATCH, 7, 8), (BATCH, 3, 8)]
    else:
        raise ValueError(name)
    return sa.compile(m), shapes


def _loss(out, target):
    """The mean over the batch (and every other entry): equal halves average to the full mean."""
    return (out - target).square().mean()


CASES = ["self_attention", "hopfield", "slot_attention"]


def _grad_worker(rank, world, init_file, case_dir):
    """One DDP rank per process: for each case, the shared weights, this rank's half of the
    batch, backward (DDP all-reduces), and the averaged gradients saved for the test."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    def one(name):  # its locals (the DDP reducer) die before the process group
        case = torch.load(pathlib.Path(case_dir) / f"{name}.pt", weights_only=True)
        layer, _ = _make(name)
        layer.load_state_dict(case["state"])
        ddp = DDP(layer)
        half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        out = ddp(*(t[half] for t in case["inputs"]))
        _loss(out, case["target"][half]).backward()  # DDP averages the gradients over ranks
        grads = {k: p.grad for k, p in layer.named_parameters()}
        torch.save(grads, pathlib.Path(case_dir) / f"{name}.grads{rank}.pt")

    try:
        for name in CASES:
            one(name)
    finally:
        import gc

        gc.collect()  # see tests/distributed.py, release_process_group
        dist.destroy_process_group()


def _spawn(fn, args, nprocs, timeout):
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):  # raises if a rank failed
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP ranks still running after {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join()


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """Every case's layer, inputs and target saved; two ranks started once for all of them
    (starting Python processes is the slow part)."""
    case_dir = tmp_path_factory.mktemp("ddp")
    cases = {}
    torch.manual_seed(0)
    for name in CASES:
        layer, shapes = _make(name)
        inputs = [torch.randn(s, dtype=f64) for s in shapes]
        with torch.no_grad():
            target = torch.randn_like(layer(*inputs))
        cases[name] = (layer, inputs, target)
        torch.save({"state": layer.state_dict(), "inputs": inputs, "target": target},
                   case_dir / f"{name}.pt")
    _spawn(_grad_worker, (WORLD, str(case_dir / "rendezvous"), str(case_dir)), WORLD, TIMEOUT)
    return case_dir, cases


@pytest.mark.parametrize("name", CASES)
def test_ddp_two_ranks_average_to_the_full_batch_gradient(name, ddp_run):
    case_dir, cases = ddp_run
    layer, inputs, target = cases[name]
    layer.zero_grad()
    _loss(layer(*inputs), target).backward()  # one process, the whole batch
    full = {k: p.grad.clone() for k, p in layer.named_parameters()}
    assert full and all(g is not None and g.abs().max() > 0 for g in full.values())
    layer.zero_grad()
    _loss(layer(*(t[: BATCH // WORLD] for t in inputs)), target[: BATCH // WORLD]).backward()
    local = {k: p.grad.clone() for k, p in layer.named_parameters()}  # rank 0 before all-reduce
    for rank in range(WORLD):
        grads = torch.load(case_dir / f"{name}.grads{rank}.pt", weights_only=True)
        assert grads.keys() == full.keys()
        for k, g in grads.items():
            assert g is not None, (rank, k)
            assert g.dtype == f64
            err = (g - full[k]).abs().max().item()
            assert err <= 1e-6, (rank, k, err)
    # the check has teeth: a rank's own half-batch gradient is not the full-batch one
    assert max((local[k] - full[k]).abs().max().item() for k in full) > 1e-3


def _run(cmd, cwd):
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, f"{cmd} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res.stdout


def _losses(stdout):
    steps = [float(v) for v in re.findall(r"^step +\d+ +loss (\S+)$", stdout, re.M)]
    final = re.search(r"^final loss (\S+) after (\d+) steps", stdout, re.M)
    assert final, stdout
    return steps, float(final.group(1)), int(final.group(2))


def test_train_ddp_under_torchrun(tmp_path):
    """Two gloo ranks via ``python -m torch.distributed.run --standalone`` (a free port)."""
    stdout = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=2", str(TRAIN), "--steps", "3"], cwd=tmp_path)
    assert "world size 2" in stdout
    steps, final, n = _losses(stdout)
    assert n == 3 and steps[-1] == final and final < steps[0]
    assert stdout.count("final loss") == 1  # rank 0 only
    assert not any(tmp_path.iterdir())  # writes nothing without --out


def test_train_ddp_single_process_iterative(tmp_path):
    """No torchrun: world size 1 from defaulted env vars; the Hopfield blocks; ``--out``."""
    stdout = _run([sys.executable, str(TRAIN), "--steps", "3", "--model", "iterative",
                   "--out", str(tmp_path / "out")], cwd=tmp_path)
    assert "world size 1" in stdout and "model iterative" in stdout
    steps, final, n = _losses(stdout)
    assert n == 3 and final < steps[0]
    record = json.loads((tmp_path / "out" / "train_ddp_losses.json").read_text())
    assert record["world_size"] == 1 and record["losses"][-1] == [3, pytest.approx(final, abs=1e-4)]

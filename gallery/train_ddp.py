"""Data-parallel training of a small transformer built from compiled structattn layers.

The network: token + learned position embeddings, ``--layers`` pre-LayerNorm residual blocks,
each ``x ← x + attn(LN(x))`` with ``attn = sa.compile(sa.models.self_attention(d_model,
heads=…, causal=True, name=f"attn{l}"))`` and ``x ← x + MLP(LN(x))``, then a final LayerNorm
and a linear head to the vocabulary. ``--model iterative`` replaces each block's MLP by an
associative memory: ``sa.compile(sa.models.hopfield(d_model,
iteration=sa.IterationOptions(steps=3)))`` whose queries are the tokens and whose stored
patterns are learned parameters (per token, so causality is kept), so every block runs a
latent iteration (three CCCP updates of the Hopfield state, back-propagated through) under
DistributedDataParallel.

The task: next-token prediction on repeating patterns. Each sequence is a random pattern of
``--period`` tokens (vocabulary ``--vocab``) repeated to ``--seq-len``; the first period is
unpredictable, so the loss is the cross entropy of the predictions of every later token
(from log V at the start to near 0 once the network copies from one period back).

Data: a fixed synthetic data set of ``--examples`` sequences, the same on every rank (one
seed); ``torch.utils.data.DistributedSampler`` gives each rank its own disjoint share of each
epoch, so the per-rank batch is ``--batch / world_size`` and DDP's averaged gradient is the
gradient of the global batch's mean loss. The ranks' shares of a step interleave one
shuffled order, so their union is the batch that a single process takes at that step: the
loss curve with N processes is the single-process one up to rounding (which training
amplifies: the curves agree to 3 decimals for the first ~250 steps, then drift apart).

Run::

    torchrun --nproc_per_node=2 gallery/train_ddp.py [--steps S] [--model iterative]
    python gallery/train_ddp.py [--steps S]      # one process: world size 1, env defaulted

Backend gloo on CPU, nccl when CUDA has a GPU per local rank. Rank 0 prints the loss
(averaged over ranks) every ``--print-every`` steps and the final loss; it writes nothing
unless ``--out DIR`` is given (then ``DIR/train_ddp_losses.json``: the arguments, the
world size and the loss curve).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import structattn as sa


# -- the network -----------------------------------------------------------------------
class HopfieldMemory(nn.Module):
    """Each token retrieves from ``patterns`` learned stored patterns with a compiled Hopfield
    layer (latent state ξ, ``update_steps`` CCCP updates): per token, no mixing across time."""

    def __init__(self, d_model, heads, patterns, update_steps, name):
        super().__init__()
        self.stored = nn.Parameter(torch.randn(patterns, d_model))
        self.retrieve = sa.compile(sa.models.hopfield(
            d_model, heads=heads, iteration=sa.IterationOptions(steps=update_steps), name=name))

    def forward(self, x):
        keys = self.stored.expand(*x.shape[:-2], *self.stored.shape)  # same batch dims as x
        return self.retrieve(x, keys)


class Block(nn.Module):
    def __init__(self, d_model, heads, index, model, patterns):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = sa.compile(sa.models.self_attention(d_model, heads=heads, causal=True,
                                                        name=f"attn{index}"))
        if model == "iterative":
            self.mix = HopfieldMemory(d_model, heads, patterns, update_steps=3, name=f"memory{index}")
        else:
            self.mix = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                     nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mix(self.ln2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab, seq_len, d_model=64, heads=4, layers=2, model="attention",
                 patterns=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads, i, model, patterns) for i in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):  # (B, T) → logits (B, T, vocab)
        x = self.tok(tokens) + self.pos[: tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# -- the task --------------------------------------------------------------------------
def repeating_patterns(n, vocab, period, seq_len, seed):
    """``n`` sequences: a random pattern of ``period`` tokens repeated to ``seq_len``."""
    g = torch.Generator().manual_seed(seed)
    pattern = torch.randint(vocab, (n, period), generator=g)
    return pattern.repeat(1, math.ceil(seq_len / period))[:, :seq_len]


def loss_fn(logits, tokens, period):
    """Cross entropy of the predictions of tokens period … T−1 (the predictable ones)."""
    pred = logits[:, period - 1:-1]
    return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), tokens[:, period:].reshape(-1))


# -- distributed set-up ----------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup():
    """Init the process group from torchrun's env vars, defaulting to one process."""
    env = dict(os.environ)
    launched = "WORLD_SIZE" in env  # by torchrun (or by hand with the env:// variables)
    if not launched:  # plain `python train_ddp.py`: one process, a free local port
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        # tiny tensors: extra threads only add overhead (and oversubscribe the cores that the
        # other ranks on this host use); OMP_NUM_THREADS overrides
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    # env:// under torchrun; the same address and port, defaulted, for a lone process
    init = "env://" if launched else f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    return dist.get_rank(), dist.get_world_size(), device


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", choices=("attention", "iterative"), default="attention",
                   help="iterative: each block's MLP becomes a compiled Hopfield memory")
    p.add_argument("--batch", type=int, default=64, help="global batch (split over the ranks)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--period", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=24)
    p.add_argument("--examples", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-every", type=int, default=25)
    p.add_argument("--out", default=None, help="directory for the loss curve (JSON); none if unset")
    args = p.parse_args(argv)

    rank, world, device = setup()
    try:
        return train(args, rank, world, device)
    finally:
        # the DDP reducer (a local of train) is gone before the group: a reducer that outlives
        # destroy_process_group frees the gloo group itself, holding the GIL while joining
        # gloo's threads, one of which may wait for the GIL — a deadlock at exit
        gc.collect()
        dist.destroy_process_group()


def train(args, rank, world, device):
    """The training loop on this rank (its DDP reducer dies with it, before the group)."""
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} is not divisible by the world size {world}")
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts rank 0's)
    net = TinyTransformer(args.vocab, args.seq_len, args.d_model, args.heads, args.layers,
                          args.model).to(device)
    ddp = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)

    data = TensorDataset(repeating_patterns(args.examples, args.vocab, args.period,
                                            args.seq_len, args.seed))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(data, batch_size=args.batch // world, sampler=sampler, drop_last=True)

    if rank == 0:
        print(f"world size {world} ({dist.get_backend()}, {device}), model {args.model}, "
              f"{sum(q.numel() for q in net.parameters())} parameters, "
              f"chance loss {math.log(args.vocab):.3f}", flush=True)
    curve, step, epoch, start = [], 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)  # a new disjoint split of a new shuffle each epoch
        for (tokens,) in loader:
            tokens = tokens.to(device)
            loss = loss_fn(ddp(tokens), tokens, args.period)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            opt.step()
            step += 1
            if step % args.print_every == 0 or step == args.steps or step == 1:
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # every rank reaches this line on the same steps
                mean = mean.item() / world
                curve.append((step, mean))
                if rank == 0:
                    print(f"step {step:5d}  loss {mean:.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        seconds = time.perf_counter() - start
        print(f"final loss {curve[-1][1]:.4f} after {step} steps ({seconds:.1f} s)", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "train_ddp_losses.json"), "w") as fh:
                json.dump({"args": vars(args), "world_size": world, "seconds": seconds,
                           "losses": curve}, fh)
    return curve


if __name__ == "__main__":
    main()

"""Train a small convolutional network on synthetic data with dcredit_opt.

    torchrun --nproc_per_node 2 examples/train.py      # torch.distributed (Gloo on CPU, NCCL on GPU)
    mpiexec -n 2 python examples/train.py             # MPI: blocks through mpi4py, control through Gloo
    horovodrun -np 2 -H localhost:2 --gloo python examples/train.py   # Horovod
    python examples/train.py                          # a world of one

The only lines that differ from single-process training are marked "# dc".
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import dcredit_opt as dc


class ConvNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * 4 * 4, 512)
        self.fc2 = nn.Linear(512, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def synthetic_data(rank: int, batches: int, batch_size: int):
    """A learnable task: the label is which quadrant of the image is brightest (plus noise)."""
    g = torch.Generator().manual_seed(1234 + rank)
    for _ in range(batches):
        y = torch.randint(0, 4, (batch_size,), generator=g)
        x = torch.randn(batch_size, 3, 32, 32, generator=g) * 1.0
        for i, q in enumerate(y.tolist()):
            r, c = divmod(q, 2)
            x[i, :, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16] += 0.25
        yield x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batches", type=int, default=20, help="batches per epoch per rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(1)

    dc.init()  # dc
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    dc.broadcast_parameters(model.state_dict(), root_rank=0)  # dc
    opt = dc.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # dc

    samples, start = 0, None
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in synthetic_data(dc.rank() * 1000 + epoch, args.batches, args.batch_size):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
            count += 1
            if start is None:
                start = time.perf_counter()  # throughput after the first (warm-up) step
            else:
                samples += args.batch_size * dc.size()
        if dc.rank() == 0:
            print(f"epoch {epoch}: mean loss {total / count:.4f}", flush=True)

    opt.synchronize()  # dc: apply the last lazy update before reading the parameters directly
    elapsed = time.perf_counter() - start
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    mine = torch.stack([flat.double().sum(), flat.double().abs().sum()])
    gathered = dc.allgather(mine.reshape(1, -1), name="example.check")  # one row per rank, on any launcher
    agree = all(torch.equal(row, gathered[0]) for row in gathered)
    if dc.rank() == 0:
        plan = opt.plan
        print(f"plan in force: {plan.policy}, {sum(len(p) for p in plan.partition)} blocks over "
              f"{plan.channels} channel(s), phase 2 {'on' if plan.overlap_forward else 'off'}")
        print(f"throughput: {samples / elapsed:.1f} samples/s on {dc.size()} rank(s)")
        print(f"ranks agree on the parameters: {agree}")
    dc.shutdown()
    if not agree:
        raise SystemExit("ranks disagree on the parameters")


if __name__ == "__main__":
    main()

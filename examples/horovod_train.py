"""A Horovod training script moved to dcredit_opt: one import and one line differ.

    horovodrun -np 2 -H localhost:2 --gloo python examples/horovod_train.py
    horovodrun -np 2 -H localhost:2 --mpi python examples/horovod_train.py
    mpiexec -n 2 python examples/horovod_train.py

Everything else is written the way Horovod's own examples are: hvd.init(),
a DistributedSampler, the learning rate scaled by hvd.size(), parameters and
optimizer state broadcast from rank 0, metrics averaged with hvd.allreduce.
The two changed lines are marked "# dc". dcredit_opt adopts the initialised
Horovod and sends its gradient blocks through Horovod's all-reduce.
"""

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data
from torch import nn

import dcredit_opt as dc  # dc


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def synthetic_mnist(samples: int) -> torch.utils.data.TensorDataset:
    """28x28 images whose label is the row band that holds a bright stripe: learnable in a few epochs."""
    g = torch.Generator().manual_seed(2024)
    labels = torch.randint(0, 10, (samples,), generator=g)
    images = torch.randn(samples, 1, 28, 28, generator=g) * 0.5
    for i, y in enumerate(labels.tolist()):
        images[i, 0, 2 * y + 4: 2 * y + 6, :] += 1.5
    return torch.utils.data.TensorDataset(images, labels)


def metric_average(value: float, name: str) -> float:
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)

    dataset = synthetic_mnist(args.samples)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    # was: optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    optimizer = dc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # dc

    for epoch in range(args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        mean_loss = metric_average(total / batches, "avg_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: mean loss {mean_loss:.4f}", flush=True)

    # A checksum of the final weights on every rank. state_dict() sees every
    # update (with dcredit_opt too, whose last update may still be pending).
    weights = torch.cat([v.double().flatten() for v in model.state_dict().values()])
    mine = torch.stack([weights.sum(), weights.abs().sum()]).unsqueeze(0)
    everyone = hvd.allgather(mine, name="final_checksum")
    agree = bool((everyone == everyone[0]).all())
    if hvd.rank() == 0:
        print(f"ranks agree on the parameters: {agree} ({hvd.size()} ranks)", flush=True)
    if not agree:
        raise SystemExit("ranks disagree on the parameters")


if __name__ == "__main__":
    main()

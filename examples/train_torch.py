"""Train a small 3D CNN with tbe_like's backward kernels, next to plain PyTorch.

Two copies of the same network start from the same weights: one built from
``tbe_like.torch.Conv3d`` (its backward passes run tbe_like's kernels, compiled on the first
step), one from ``torch.nn.Conv3d``. Both take the same SGD steps on the same random video clips;
the losses are printed side by side and must agree.

    python -m pip install -e ".[torch]"
    python examples/train_torch.py
"""

from __future__ import annotations

import time

import torch

from tbe_like import torch as tt

STEPS = 6


def network(conv) -> torch.nn.Module:
    """Clips (N, 3, 8, 32, 32) -> 5 classes: a stem, a strided block, pooling, a classifier."""
    return torch.nn.Sequential(
        conv(3, 16, kernel_size=(3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2)),
        torch.nn.ReLU(),
        conv(16, 32, kernel_size=3, stride=2, padding=1),
        torch.nn.ReLU(),
        conv(32, 32, kernel_size=(3, 1, 1), padding=(1, 0, 0)),  # a temporal convolution
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool3d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 5),
    )


def main() -> None:
    torch.manual_seed(0)
    ours, theirs = network(tt.Conv3d), network(torch.nn.Conv3d)
    theirs.load_state_dict(ours.state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    clips = torch.randn(STEPS, 4, 3, 8, 32, 32)
    labels = torch.randint(0, 5, (STEPS, 4))
    print(f"{'step':>4} {'tbe_like loss':>14} {'torch loss':>12} {'tbe_like s':>11} {'torch s':>8}")
    worst = 0.0
    for step in range(STEPS):
        losses, seconds = [], []
        for model, opt in zip((ours, theirs), optimizers, strict=True):
            start = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(clips[step]), labels[step])
            loss.backward()
            opt.step()
            seconds.append(time.perf_counter() - start)
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
        print(f"{step:4d} {losses[0]:14.6f} {losses[1]:12.6f} {seconds[0]:11.3f} "
              f"{seconds[1]:8.3f}" + ("   (compiles the kernels)" if step == 0 else ""))
    assert worst < 1e-4, f"the two trainings diverged: loss difference {worst:.2e}"
    print(f"largest loss difference {worst:.1e}: the same training")


if __name__ == "__main__":
    main()
